"""Maintenance: garbage collection, recovery, scrub, quarantine, cleaning, doctor, and the
background maintainer.
"""
