"""spoolctl: a persistent, rank-local prompt/KV cache toolkit for LLM inference.

The import package is deliberately light: ``import spoolctl`` and
``import spoolctl.store`` pull no inference framework (torch, vllm, mlx,
google-genai); those are imported only inside the adapter that needs them.
"""

__version__ = "0.1.0"
