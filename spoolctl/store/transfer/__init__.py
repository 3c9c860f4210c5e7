"""Moving entries between hosts: the archive format, export, import, a peer's root, where stores
live under a root.
"""
