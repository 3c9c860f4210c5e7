"""The worker side of the connector: one rank's store, restores into KV blocks, captures and off-
critical-path commits, the exit drain.
"""
