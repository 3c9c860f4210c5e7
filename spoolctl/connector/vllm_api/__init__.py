"""The only modules that look inside vLLM: its connector API checked, its config introspected, its
stats, KV event and metadata classes adapted; ``protocols`` types the vLLM objects read.
"""
