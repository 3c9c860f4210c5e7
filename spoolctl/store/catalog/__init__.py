"""The catalog: a derived SQLite index over the manifests, its schema and rows, its health and its
bulk load.
"""
