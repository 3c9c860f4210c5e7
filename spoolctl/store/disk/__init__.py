"""The store's file system I/O: durable writes, verified reads, directory descriptors, locks,
SQLite files, the reserve file, the root's layout.
"""
