"""The scheduler side of the connector: lookups across the rank stores, the coordination of
restores, stores and KV events.
"""
