"""What the store writes, as pure data: entry keys, manifests, digests, entry tags, sizes, clocks
(no I/O).
"""
