"""The only modules that look inside vLLM: its connector API checked, its config introspected, its
stats and KV event classes adapted.
"""
