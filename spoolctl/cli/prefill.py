"""``spoolctl prefill`` (prefill one prompt into the store) and ``spoolctl demo``.

Thin: parses options, builds ``CachePrepareParams``, calls the controller or the
demo job, renders. Frameworks are imported only when a command runs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from spoolctl.store import format_size
from spoolctl.store.errors import ConfigError

from .app import app
from .common import (
    ENV_ROOT,
    JsonOption,
    RootOption,
    console,
    default_root,
    emit_json,
    err_console,
    resolve_root,
)

MAX_PROMPT_FILE = 64 << 20


def _read_text(path: Path, what: str) -> str:
    try:
        if path.stat().st_size > MAX_PROMPT_FILE:
            raise ConfigError(f"{what} is larger than {format_size(MAX_PROMPT_FILE)}", path=path,
                              fix="prefill a shorter prompt")
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} not found", path=path, fix="check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {what}: {exc}", path=path,
                          fix="pass a readable UTF-8 text file") from None


def params_from_messages(doc: Any, model: str, path: Path | None = None) -> Any:
    """Build CachePrepareParams from a messages file: either a JSON list of chat messages
    (``system`` ones become instructions, the rest data) or an object with
    ``instructions``, ``data``, ``tools``, ``reasoning_effort``, ``formatter_options``."""
    from spoolctl.controllers import CachePrepareParams

    if isinstance(doc, list):
        if not all(isinstance(m, dict) for m in doc):
            raise ConfigError("a messages list must hold objects", path=path,
                              fix='use [{"role": "system", "content": "..."}, ...]')
        instructions = [m for m in doc if m.get("role") == "system"]
        data = [m for m in doc if m.get("role") != "system"]
        return CachePrepareParams(model=model, instructions=instructions, data=data)
    if isinstance(doc, dict):
        allowed = {"instructions", "data", "tools", "reasoning_effort", "formatter_options"}
        unknown = set(doc) - allowed
        if unknown:
            raise ConfigError(f"unknown fields {sorted(unknown)} in the messages file", path=path,
                              fix=f"use only: {', '.join(sorted(allowed))}")
        return CachePrepareParams(model=model, instructions=doc.get("instructions", []),
                                  data=doc.get("data", []), tools=doc.get("tools", []),
                                  reasoning_effort=doc.get("reasoning_effort"),
                                  formatter_options=doc.get("formatter_options", {}))
    raise ConfigError("the messages file must hold a JSON list or object", path=path,
                      fix='use [{"role": "system", "content": "..."}, ...]')


def _load_messages(path: Path, model: str) -> Any:
    text = _read_text(path, "messages file")
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"messages file is not valid JSON ({exc})", path=path,
                          fix="fix the JSON syntax") from None
    try:
        return params_from_messages(doc, model, path)
    except ConfigError as exc:
        if exc.path is None:
            exc.path = str(path)
        raise


@app.command("prefill")
def prefill_cmd(
    model: Annotated[Path, typer.Option("--model", help="Local model directory.")],
    backend: Annotated[str, typer.Option("--backend", help="pytorch or mlx.")] = "pytorch",
    prompt: Annotated[str | None, typer.Option("--prompt", help="Prompt text.")] = None,
    prompt_file: Annotated[Path | None, typer.Option("--prompt-file",
                                                     help="Prompt text file.")] = None,
    messages_file: Annotated[Path | None, typer.Option(
        "--messages-file", help="JSON chat messages (or {instructions, data, tools}).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="pytorch: float32, float16, bfloat16.")
                     ] = "float32",
    device: Annotated[str, typer.Option("--device", help="pytorch: cpu, cuda, mps...")] = "cpu",
    image: Annotated[list[Path] | None, typer.Option(
        "--image", metavar="<file>", show_default=False,
        help="mlx: an image placed before the prompt (repeatable); uses mlx-vlm.")] = None,
    max_image_size: Annotated[int | None, typer.Option(
        "--max-image-size", metavar="<pixels>", show_default=False,
        help="mlx with --image: longest image edge in pixels.")] = None,
    root: RootOption = None,
    json_out: JsonOption = False,
) -> None:
    """Prefill a prompt's cacheable prefix into the store (a second run is a cache hit).

    Example: [bold]spoolctl prefill --model /models/llama --prompt-file manual.txt --json[/bold]
    """
    from spoolctl.controllers import BACKENDS, CachePrepareParams, LocalCacheController

    sources = [s for s in (prompt, prompt_file, messages_file) if s is not None]
    if len(sources) != 1:
        raise ConfigError("give exactly one of --prompt, --prompt-file, --messages-file",
                          fix="e.g. spoolctl prefill --model DIR --prompt-file prompt.txt")
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}", fix=f"use one of: {', '.join(BACKENDS)}")
    model_dir = model.expanduser().resolve()
    if not model_dir.is_dir():
        raise ConfigError("model directory not found", path=model_dir,
                          fix="pass a local model directory (save_pretrained format)")
    if messages_file is not None:
        params = _load_messages(messages_file, str(model_dir))
    else:
        text = prompt if prompt is not None else _read_text(prompt_file, "prompt file")
        if not text:
            raise ConfigError("the prompt is empty", fix="pass a non-empty prompt")
        params = CachePrepareParams(model=str(model_dir), instructions=[text])
    if max_image_size is not None and not image:
        raise ConfigError("--max-image-size needs --image", fix="add --image FILE")
    if image:
        if backend != "mlx":
            raise ConfigError("--image needs --backend mlx (mlx-vlm)",
                              fix="add --backend mlx, or drop --image")
        _prefill_vlm(model_dir, params, image or [], max_image_size, root, json_out)
        return
    t0 = time.perf_counter()
    if backend == "pytorch":
        from spoolctl.controllers.pytorch import PyTorchBackend, quiet_frameworks

        quiet_frameworks()
        kv = PyTorchBackend(model_dir, dtype=dtype, device=device)
    else:
        from spoolctl.controllers import load_backend

        kv = load_backend(backend, model_dir)
    load_s = time.perf_counter() - t0
    _prepare_and_render(LocalCacheController(kv, resolve_root(root)), params, json_out,
                        backend=backend, model=str(model_dir), load_s=load_s)


def _prefill_vlm(model_dir: Path, params: Any, images: list[Path], max_image_size: int | None,
                 root: Any, json_out: bool) -> None:
    """``prefill --backend mlx --image FILE``: the mlx-vlm controller (images in the key)."""
    import dataclasses

    from spoolctl.controllers.mlx_vlm import MlxVlmBackend, MlxVlmCacheController

    for path in images:
        if not path.expanduser().is_file():
            raise ConfigError("image file not found", path=path, fix="check the --image path")
    params = dataclasses.replace(params, images=[str(p.expanduser().resolve()) for p in images],
                                 max_image_size=max_image_size)
    t0 = time.perf_counter()
    kv = MlxVlmBackend(model_dir)
    load_s = time.perf_counter() - t0
    _prepare_and_render(MlxVlmCacheController(kv, resolve_root(root)), params, json_out,
                        backend="mlx", model=str(model_dir), load_s=load_s,
                        extra={"images": len(params.images),
                               "vlm_mode": "image" if params.images else "text"})


def _prepare_and_render(ctl: Any, params: Any, json_out: bool, *, backend: str, model: str,
                        load_s: float, extra: dict | None = None) -> None:
    """Prepare ``params`` on ``ctl`` (closed afterwards), then print what it did."""
    with ctl:
        t1 = time.perf_counter()
        handle = ctl.prepare(params)
        seconds = time.perf_counter() - t1
        store_root = str(ctl.store.root)
    if not handle:
        raise ConfigError("nothing to prefill: the prompt has no cacheable prefix",
                          fix="mark fewer elements volatile")
    doc = {"entry_id": handle.ref, "backend": backend, "model": model,
           "root": store_root, "tokens": handle.cached_tokens,
           "tokens_written": handle.written_tokens, "tokens_reused": handle.reused_tokens,
           "source": handle.source, "supersedes": handle.supersedes, **(extra or {}),
           "seconds": round(seconds, 4), "model_load_seconds": round(load_s, 4)}
    _render_prefill(doc, json_out)


def _render_prefill(doc: dict, json_out: bool) -> None:
    if json_out:
        emit_json(doc)
        return
    table = Table(title="spoolctl prefill", show_header=False)
    for label, key in (("entry", "entry_id"), ("source", "source"), ("tokens", "tokens"),
                       ("tokens written", "tokens_written"),
                       ("tokens reused from a base", "tokens_reused"),
                       ("seconds", "seconds"), ("store", "root")):
        table.add_row(label, str(doc[key]))
    console.print(table)


def _models_home() -> Path:
    """<cache dir>/models, never inside a store root: when $SPOOLCTL_ROOT names the store
    itself, the platform cache dir is used instead (a store root holds only store files)."""
    base = default_root()
    if os.environ.get(ENV_ROOT):
        if sys.platform == "darwin":
            base = Path.home() / "Library" / "Caches" / "spoolctl"
        else:
            base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spoolctl"
    return base / "models"


@app.command("demo")
def demo_cmd(
    root: RootOption = None,
    json_out: JsonOption = False,
    preset: Annotated[str, typer.Option(
        "--preset", help="Model size: small (default) or tiny (a quick check).")] = "small",
    model_dir: Annotated[Path | None, typer.Option(
        "--model-dir", help="Where the generated model lives. Default: <cache dir>/models/"
        "<preset>.", show_default=False)] = None,
) -> None:
    """Prefill long prompts cold, reuse them from disk, extend one, clean up; show speedups.

    Example: [bold]spoolctl demo --preset tiny --json[/bold]
    """
    from spoolctl.demo import run_demo

    if preset not in ("small", "tiny"):
        raise ConfigError(f"unknown preset {preset!r}", fix="use small or tiny")
    target = (model_dir or _models_home() / preset).expanduser().resolve()
    quiet = json_out or not err_console.is_terminal
    report = run_demo(resolve_root(root).expanduser(), target, preset=preset,
                      progress=None if quiet else (lambda m: err_console.print(f"[dim]{m}[/dim]")))
    if json_out:
        emit_json(report.to_json())
        return
    table = Table(title="spoolctl demo: prompt cache on local disk (PyTorch, CPU)")
    for col in ("prompt", "tokens", "cold s", "warm s", "speedup", "same tokens"):
        table.add_column(col, justify="left" if col == "prompt" else "right")
    for r in report.rows:
        table.add_row(r.name, str(r.tokens), f"{r.cold_s:.3f}", f"{r.warm_s:.3f}",
                      f"{r.speedup:.1f}x", "yes" if r.same_tokens else "[red]NO[/red]")
    inc = report.incremental
    if inc is not None:
        table.add_row(f"{inc.name} (+{inc.written_tokens} tokens, incremental)", str(inc.tokens),
                      f"{inc.cold_s:.3f}", f"{inc.warm_s:.3f}", f"{inc.speedup:.1f}x",
                      "yes" if inc.same_tokens else "[red]NO[/red]")
    console.print(table)
    console.print(
        f"store {report.root}: the demo wrote {report.entries_created} entries "
        f"({format_size(report.bytes_created)}); after release + close "
        f"{report.entries_after_cleanup} remain. Store now: {report.store_entries} entries, "
        f"{format_size(report.store_bytes)}.")
    console.print("warm = prepare() in a fresh controller (nothing in memory): read from disk, "
                  "verified, loaded. cold s of the incremental row = a cold prefill of the "
                  "grown prompt.")
