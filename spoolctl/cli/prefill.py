"""``spoolctl prefill`` (prefill one prompt into the store) and ``spoolctl demo``.

Thin: parses options, builds ``CachePrepareParams``, calls the controller or the
demo job, renders. Frameworks are imported only when a command runs.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from spoolctl.errors import ConfigError
from spoolctl.store import format_size

from .common import (
    EXIT_FINDINGS,
    JsonOption,
    RootOption,
    console,
    default_root,
    deprecated_alias,
    emit_json,
    err_console,
    plain,
    resolve_root,
    text,
)

if TYPE_CHECKING:
    from spoolctl.controllers import KVBackend

# This module's commands: cli/commands.py adds them to the spoolctl app (the one place
# that lists every command).
commands = typer.Typer()

MAX_PROMPT_FILE = 64 << 20


def _prompt_text(prompt: str | None, prompt_file: Path | None) -> str:
    """``--prompt``, or the text of ``--prompt-file``; ConfigError when it is empty."""
    if prompt is not None:
        found = prompt
    else:
        found = _read_text(prompt_file, "prompt file") if prompt_file is not None else ""
    if not found:
        raise ConfigError("the prompt is empty", fix="pass a non-empty prompt")
    return found


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
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise ConfigError(f"messages file is not valid JSON ({str(exc)[:200]})", path=path,
                          fix="fix the JSON syntax") from None
    try:
        return params_from_messages(doc, model, path)
    except ConfigError as exc:
        if exc.path is None:
            exc.path = str(path)
        raise


@commands.command("prefill")
def prefill_cmd(
    model: Annotated[str | None, typer.Option(
        "--model", metavar="<dir|name>",
        help="Local model directory; with --server, the served model name "
        "(default: the server's only model).", show_default=False)] = None,
    backend: Annotated[str, typer.Option("--backend", help="pytorch or mlx.")] = "pytorch",
    server: Annotated[str | None, typer.Option(
        "--server", metavar="<url>", show_default=False,
        help="A running vLLM server (OpenAI API, e.g. http://127.0.0.1:8000): send each "
        "prompt as a one-token request so the server prefills and stores it.")] = None,
    prompts_file: Annotated[str | None, typer.Option(
        "--prompt-list", metavar="<file|->", show_default=False,
        help="--server: JSON Lines, one prompt per line: \"text\", [token ids] or "
        "{\"prompt\": ..., \"cache_salt\": ..., \"name\": ...}.")] = None,
    concurrency: Annotated[int, typer.Option(
        "--concurrency", min=1, max=256, help="--server: requests in flight at once.")] = 4,
    rate: Annotated[float | None, typer.Option(
        "--rate", min=0.001, show_default=False, metavar="<requests/s>",
        help="--server: at most this many requests per second.")] = None,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=0.1, help="--server: seconds to wait for one response.")] = 600.0,
    retries: Annotated[int, typer.Option(
        "--retries", min=0, max=20, help="--server: retries of a transient failure "
        "(connection error, 429, 502-504).")] = 3,
    prompt: Annotated[str | None, typer.Option("--prompt", help="Prompt text.")] = None,
    prompt_file: Annotated[Path | None, typer.Option("--prompt-file",
                                                     help="Prompt text file.")] = None,
    messages_file: Annotated[Path | None, typer.Option(
        "--messages-file", help="JSON chat messages (or {instructions, data, tools}).")] = None,
    dtype: Annotated[str | None, typer.Option(
        "--dtype", help="pytorch: float32, float16, bfloat16 (default: the checkpoint's, as "
                        "transformers loads it).")] = None,
    device: Annotated[str, typer.Option("--device", help="pytorch: cpu, cuda, mps...")] = "cpu",
    image: Annotated[list[Path] | None, typer.Option(
        "--image", metavar="<file>", show_default=False,
        help="mlx: an image placed before the prompt (repeatable); uses mlx-vlm.")] = None,
    max_image_size: Annotated[int | None, typer.Option(
        "--max-image-size", metavar="<pixels>", show_default=False,
        help="mlx with --image: longest image edge in pixels.")] = None,
    root: RootOption = None,
    json_out: JsonOption = False,
    old_prompts_file: Annotated[str | None, typer.Option(
        "--prompts-file", hidden=True, help="Deprecated name of --prompt-list.")] = None,
) -> None:
    """Prefill a prompt's cacheable prefix into the store (a second run is a cache hit).

    Needs the extra of its backend: pip install 'spoolctl[torch]' (or [mlx], [vlm]); --server
    needs none.

    With --server, warm a running vLLM server instead (e.g. a replica started after
    deploy): each prompt of --prompt-list is sent as a one-token request, with bounded
    concurrency and rate; per prompt the server's cached vs computed tokens are reported
    (start vLLM with --enable-prompt-tokens-details to get the cached count). Exit 1 if a
    prompt failed.

    Example: [bold]spoolctl prefill --model /models/llama --prompt-file manual.txt --json[/bold]

    Example: [bold]spoolctl prefill --server http://127.0.0.1:8000 --prompt-list
    prompts.jsonl --concurrency 8[/bold]
    """
    from spoolctl.controllers import BACKENDS, CachePrepareParams, Element, LocalCacheController

    prompts_file = deprecated_alias("--prompts-file", "--prompt-list", old_prompts_file,
                                    prompts_file)
    if server is not None:
        _prefill_server(server, model, prompt, prompt_file, prompts_file, messages_file,
                        concurrency=concurrency, rate=rate, timeout=timeout, retries=retries,
                        json_out=json_out)
        return
    if prompts_file is not None:
        raise ConfigError("--prompt-list needs --server",
                          fix="use --prompt-file for one prompt into the local store")
    if model is None:
        raise ConfigError("--model is required", fix="pass a local model directory")
    sources = [s for s in (prompt, prompt_file, messages_file) if s is not None]
    if len(sources) != 1:
        raise ConfigError("give exactly one of --prompt, --prompt-file, --messages-file",
                          fix="e.g. spoolctl prefill --model DIR --prompt-file prompt.txt")
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}", fix=f"use one of: {', '.join(BACKENDS)}")
    model_dir = Path(model).expanduser().resolve()
    if not model_dir.is_dir():
        raise ConfigError("model directory not found", path=model_dir,
                          fix="pass a local model directory (save_pretrained format)")
    if messages_file is not None:
        params = _load_messages(messages_file, str(model_dir))
    else:
        params = CachePrepareParams(model=str(model_dir),
                                    instructions=[Element(_prompt_text(prompt, prompt_file))])
    if max_image_size is not None and not image:
        raise ConfigError("--max-image-size needs --image", fix="add --image FILE")
    if image:
        if backend != "mlx":
            raise ConfigError("--image needs --backend mlx (mlx-vlm)",
                              fix="add --backend mlx, or drop --image")
        _prefill_vlm(model_dir, params, image or [], max_image_size, root, json_out)
        return
    t0 = time.perf_counter()
    kv = _load_backend(backend, model_dir, dtype=dtype, device=device)
    load_s = time.perf_counter() - t0
    _prepare_and_render(LocalCacheController(kv, resolve_root(root)), params, json_out,
                        backend=backend, model=str(model_dir), load_s=load_s)


def _load_backend(backend: str, model_dir: Path, *, dtype: str | None,
                  device: str) -> KVBackend:
    """The ``backend`` for ``model_dir``; ``dtype`` and ``device`` are PyTorch's."""
    from spoolctl.controllers import load_backend

    if backend == "pytorch":
        from spoolctl.controllers.pytorch import quiet_frameworks

        quiet_frameworks()
        return load_backend(backend, model_dir, dtype=dtype, device=device)
    return load_backend(backend, model_dir)


def _prefill_server(url: str, model: str | None, prompt: str | None, prompt_file: Path | None,
                    prompts_file: str | None, messages_file: Path | None, *, concurrency: int,
                    rate: float | None, timeout: float, retries: int, json_out: bool) -> None:
    """``prefill --server``: warm a running vLLM server (spoolctl.server_warmup)."""
    from rich.text import Text

    from spoolctl import server_warmup as sw

    if messages_file is not None:
        raise ConfigError("--messages-file is for the local backends",
                          fix="with --server use --prompt-list (JSON Lines) or --prompt")
    sources = [s for s in (prompt, prompt_file, prompts_file) if s is not None]
    if len(sources) != 1:
        raise ConfigError("with --server give exactly one of --prompt-list, --prompt, "
                          "--prompt-file", fix="e.g. --prompt-list prompts.jsonl")
    target = sw.Server.parse(url)
    if prompts_file is not None:
        prompts = sw.read_prompts_file(prompts_file)
    else:
        prompts = [sw.WarmPrompt("#1", _prompt_text(prompt, prompt_file))]
    client = sw.Client(target, timeout=timeout,
                       api_key=os.environ.get(sw.API_KEY_ENV) or None)
    try:
        served = sw.served_models(client)
    except sw.ServerError as exc:
        raise ConfigError(f"cannot reach the server's model list ({exc})",
                          path=client.server.url,
                          fix="check --server and that vLLM is up (GET /v1/models)") from None
    if model is None:
        if len(served) != 1:
            raise ConfigError(f"the server serves {len(served)} models",
                              path=client.server.url, fix="name one with --model")
        model = served[0]
    elif model not in served:
        raise ConfigError(f"the server does not serve {model[:120]!r}", path=client.server.url,
                          fix=f"use one of: {', '.join(served[:5]) or 'none'}")
    show = not json_out and err_console.is_terminal
    done = [0, 0, 0]  # prompts, prompt tokens, cached tokens

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(TextColumn("[bold]prefill"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[tokens]}"), console=err_console.get(), transient=True,
                  disable=not show) as bar:
        task = bar.add_task("prefill", total=len(prompts), tokens="")

        def progress(r: sw.PromptResult) -> None:
            done[0] += 1
            done[1] += r.prompt_tokens or 0
            done[2] += r.cached_tokens or 0
            bar.update(task, completed=done[0],
                       tokens=f"{done[1]} tokens, {done[2]} cached")

        report = sw.warm(client, model, prompts, concurrency=concurrency, rate=rate,
                         retries=retries, progress=progress)
    doc = report.to_json()
    if json_out:
        emit_json(doc)
    else:
        for renderable in _server_view(doc):
            console.print(renderable)
    if report.interrupted is not None:  # what was done is printed: 130 / 143
        from .interrupt import exit_code, reported, signal_name

        reported()
        err_console.print(Text(f"interrupted ({signal_name(report.interrupted)}): "
                               f"{doc['ok']} prompts prefilled, {report.not_sent} not sent, "
                               f"{report.abandoned} in flight not waited for"), soft_wrap=True)
        raise typer.Exit(exit_code(report.interrupted))
    if report.failed:
        raise typer.Exit(EXIT_FINDINGS)


def _server_view(doc: dict[str, Any]) -> list[Any]:
    """The human report of ``prefill --server``. Prompt names come from the prompts file,
    errors and the URL from the server or the user: data, never markup (``text``)."""
    from rich.table import Table
    from rich.text import Text

    def num(v: int | None) -> str:
        return "n/a" if v is None else str(v)

    table = Table(title=text(f"spoolctl prefill --server {doc['server']}"), title_justify="left")
    for col in ("prompt", "tokens", "cached", "computed", "seconds", "result"):
        table.add_column(col, justify="left" if col in ("prompt", "result") else "right")
    for r in doc["results"]:
        table.add_row(text(r["name"]), num(r["prompt_tokens"]), num(r["cached_tokens"]),
                      num(r["computed_tokens"]), f"{r['seconds']:.3f}",
                      "ok" if r["ok"] else text(r["error"] or "", "red"))
    out: list[Any] = [table, Text(
        f"{doc['ok']} of {doc['prompts']} prompts prefilled in {doc['seconds']:.2f}s: "
        f"{doc['prompt_tokens']} prompt tokens, {num(doc['cached_tokens'])} cached, "
        f"{num(doc['computed_tokens'])} computed")]
    if doc["ok"] and not doc["cached_reported"]:
        out.append(Text("the server does not report cached tokens: start vLLM with "
                        "--enable-prompt-tokens-details"))
    return out


def _prefill_vlm(model_dir: Path, params: Any, images: list[Path], max_image_size: int | None,
                 root: Any, json_out: bool) -> None:
    """``prefill --backend mlx --image FILE``: the mlx-vlm controller (images in the key)."""
    import dataclasses

    from spoolctl.controllers.mlx.vlm import MlxVlmBackend, MlxVlmCacheController

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
                        load_s: float, extra: dict[str, Any] | None = None) -> None:
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


def _render_prefill(doc: dict[str, Any], json_out: bool) -> None:
    from rich.table import Table
    if json_out:
        emit_json(doc)
        return
    table = Table(title="spoolctl prefill", show_header=False)
    for label, key in (("entry", "entry_id"), ("source", "source"), ("tokens", "tokens"),
                       ("tokens written", "tokens_written"),
                       ("tokens reused from a base", "tokens_reused"),
                       ("seconds", "seconds"), ("store", "root")):
        table.add_row(label, text(doc[key]))  # the root is store text: data, not markup
    console.print(table)


def _models_home() -> Path:
    """<cache dir>/models, never inside a store root (``$SPOOLCTL_ROOT`` names a root, not
    the cache dir: a store root holds only store files)."""
    return default_root() / "models"


@commands.command("demo")
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

    Needs the torch extra: pip install 'spoolctl[torch]'.

    Example: [bold]spoolctl demo --preset tiny --json[/bold]
    """
    from rich.table import Table
    from rich.text import Text

    from spoolctl.demo import run_demo

    if preset not in ("small", "tiny"):
        raise ConfigError(f"unknown preset {preset!r}", fix="use small or tiny")
    target = (model_dir or _models_home() / preset).expanduser().resolve()
    quiet = json_out or not err_console.is_terminal
    report = run_demo(resolve_root(root).expanduser(), target, preset=preset,
                      progress=None if quiet else (lambda m: err_console.print(text(m, "dim"))))
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
    console.print(Text(
        f"store {plain(report.root)}: the demo wrote {report.entries_created} entries "
        f"({format_size(report.bytes_created)}); after release + close "
        f"{report.entries_after_cleanup} remain. Store now: {report.store_entries} entries, "
        f"{format_size(report.store_bytes)}."))
    console.print("warm = prepare() in a fresh controller (nothing in memory): read from disk, "
                  "verified, loaded. cold s of the incremental row = a cold prefill of the "
                  "grown prompt.")
