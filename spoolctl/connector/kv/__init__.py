"""KV blocks and how they are stored: vLLM's paged KV layouts proven against the tensors, block
copies, the two stored chunk formats.
"""
