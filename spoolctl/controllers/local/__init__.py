"""The local engine shared by the PyTorch, MLX and mlx-vlm controllers: entry formats, prompt
rendering, token prefixes, decoding, usage.
"""
