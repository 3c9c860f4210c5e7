"""What the scheduler and the workers agree on, as pure data: chunk-chain keys, KV cache groups,
restore/store plans, admission, wire messages, rank inventories, KV events.
"""
