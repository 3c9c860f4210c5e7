"""Every Python and shell block of the pages below runs, on CPU, with tiny local models.

A reader copies these blocks; a block that fails as written is a bug. Rules:

* Pages covered: ``PAGES`` (the lead extends the list; pages other helpers own are not
  run yet, so their additions cannot fail here for trivial reasons).
* Blocks: fenced ```` ```python ````, ```` ```bash ````, ```` ```sh ```` and
  ```` ```console ```` (its ``$ `` lines). Python blocks run with the test interpreter, shell
  blocks with ``bash -euo pipefail``; both in a fresh directory with ``HOME`` there (so
  ``~/.cache/spoolctl/store`` is private), the test venv's ``bin`` first on ``PATH`` (as for a
  user who installed spoolctl) and ``.venv`` linked to it (as after ``scripts/run.sh``).
* Placeholder paths a reader replaces with their own are mapped (``PLACEHOLDERS``):
  ``/models/llama`` is the tiny Llama with a chat template (PyTorch and mlx-lm load it),
  ``/models/qwen2-vl-2b`` a tiny Qwen2-VL, ``/var/cache/...`` and ``/data/...`` live in the
  fresh directory, where ``chart.png`` exists.
* ``pip install`` lines are checked, not run (CI has no business installing from PyPI): every
  extra they name exists in ``pyproject.toml`` and every ``==`` pin equals
  ``scripts/constraints.txt``.
* Blocks included from ``examples/`` (``--8<--``) run in ``tests/test_examples.py``.
* Opt-out: ``<!-- snippet: skip: REASON -->`` on the line before the fence, for a block that
  cannot run here (it starts a server, needs a key and the network, or is the test suite
  itself). ``test_opt_outs_are_few_and_say_why`` lists them; keep it short.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = ["README.md", "docs/index.md", "docs/quickstart.md", "docs/install.md",
         "docs/concepts.md", "docs/controllers.md", "docs/controllers-mlx-vlm.md"]
LANGS = {"python", "bash", "sh", "console"}
SKIP = re.compile(r"<!--\s*snippet:\s*skip:\s*(?P<reason>.+?)\s*-->")
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)\s*$")
#: Known opt-outs (page, reason start): a new one must be added here on purpose.
OPT_OUTS = {
    ("README.md", "builds .venv and runs the whole test suite"),
    ("docs/quickstart.md", "builds .venv and runs the whole test suite"),
    ("docs/install.md", "starts a vLLM server on a real model"),
    ("docs/install.md", "builds the sdist and wheel"),
    ("docs/install.md", "starts a web server (mkdocs serve)"),
    ("docs/controllers.md", "talks to the Gemini API"),
}
TIMEOUT = 600


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    code: str
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    lines = (REPO / page).read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m["lang"]:
            i += 1
            continue
        indent, start = m["indent"], i
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        body = "\n".join(line[len(indent):] for line in lines[start + 1:j])
        lang = m["lang"].lower()
        prev = lines[start - 1] if start > 0 else ""
        skip = SKIP.search(prev)
        if lang in LANGS and "--8<--" not in body:
            out.append(Block(page, start + 1, lang, body + "\n", skip["reason"] if skip else None))
        i = j + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]


def test_the_covered_pages_have_runnable_blocks_and_markers_are_attached():
    assert {b.page for b in ALL if b.skip is None} >= {"docs/controllers.md",
                                                       "docs/quickstart.md"}
    for page in PAGES:  # a marker must sit right before a block, or it silently does nothing
        lines = (REPO / page).read_text().splitlines()
        for n, line in enumerate(lines):
            if SKIP.search(line):
                assert n + 1 < len(lines) and FENCE.match(lines[n + 1]), f"{page}:{n + 1}"


def test_opt_outs_are_few_and_say_why():
    found = {(b.page, b.skip) for b in ALL if b.skip}
    for page, reason in found:
        assert any(page == p and reason.startswith(r) for p, r in OPT_OUTS), \
            f"new opt-out {page}: {reason!r}: add it to OPT_OUTS on purpose (or make it run)"
    assert len(found) == len(OPT_OUTS) <= 8


# -- running ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_chat_model_dir) -> dict[str, Path]:
    """What the placeholders point at: models and a picture, built once."""
    out = {"llama": tiny_chat_model_dir}
    try:
        import mlx_vlm  # noqa: F401
        from PIL import Image

        from spoolctl.tinyvlm import build_tiny_vlm

        out["vlm"] = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl")
        picture = tmp_path_factory.mktemp("pictures") / "chart.png"
        img = Image.new("RGB", (56, 56), (255, 255, 255))
        img.paste(Image.new("RGB", (28, 28), (20, 20, 220)), (14, 14))
        img.save(picture)
        out["picture"] = picture
    except ImportError:
        pass
    return out


def placeholders(world: dict[str, Path], cwd: Path) -> list[tuple[str, str]]:
    """(placeholder, replacement), longest first."""
    pairs = [("/models/llama", str(world["llama"])), ("/var/cache/", f"{cwd}/var/cache/"),
             ("/data/", f"{cwd}/data/")]
    if "vlm" in world:
        pairs.append(("/models/qwen2-vl-2b", str(world["vlm"])))
    return sorted(pairs, key=lambda p: -len(p[0]))


def needs(block: Block, world: dict[str, Path]) -> str | None:
    """Why a block cannot run in this environment (a missing optional framework), or None."""
    if ".venv/" in block.code and not (Path(sys.prefix) / "bin" / "activate").exists():
        return "the tests do not run in a virtualenv (the page's .venv)"
    if "qwen2-vl" in block.code and "vlm" not in world:
        return "mlx-vlm is not installed here"
    if re.search(r"\bmlx\b|Mlx", block.code):
        try:
            import mlx.core  # noqa: F401
        except ImportError:
            return "mlx is not installed here"
    return None


def check_pip(line: str) -> None:
    """A ``pip install`` line names only existing extras and pins what constraints pin."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    pins = dict(line.split("==", 1) for line in
                (REPO / "scripts/constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    for word in shlex.split(line, comments=True):
        m = re.fullmatch(r"spoolctl\[([\w,-]+)\]|\.\[([\w,-]+)\]", word)
        if m:
            for extra in (m[1] or m[2]).split(","):
                assert extra in extras, f"pip line names an unknown extra {extra!r}: {line}"
        pin = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[\w,]+\])?==([\w.]+)", word)
        if pin and pin[1] in pins:
            assert pins[pin[1]] == pin[3], f"{word} differs from scripts/constraints.txt"


def shell_commands(block: Block) -> tuple[str, list[str]]:
    """The script to run (pip install lines removed) and the pip lines."""
    text = block.code
    if block.lang == "console":
        text = "\n".join(line[2:] for line in text.splitlines() if line.startswith("$ "))
    joined = re.sub(r"\\\n\s*", " ", text)
    run, pip = [], []
    for line in joined.splitlines():
        bare = line.strip()
        if re.match(r"(python3? -m )?pip install\b", bare):
            pip.append(bare)
        else:
            run.append(line)
    return "\n".join(run), pip


@pytest.mark.parametrize("block", [b for b in ALL if b.skip is None], ids=lambda b: b.id)
def test_doc_block_runs(block: Block, world, tmp_path: Path) -> None:
    why = needs(block, world)
    if why:
        pytest.skip(why)
    cwd = tmp_path / "work"
    (cwd / "data").mkdir(parents=True)
    (cwd / "var" / "cache").mkdir(parents=True)
    (cwd / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    if "picture" in world:
        for dest in (cwd / "chart.png", cwd / "data" / "chart.png"):
            dest.write_bytes(world["picture"].read_bytes())
    code = block.code
    for placeholder, real in placeholders(world, cwd):
        code = code.replace(placeholder, real)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOOLCTL_")}
    env.update({"HOME": str(cwd), "XDG_CACHE_HOME": str(cwd / ".cache"), "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "NO_COLOR": "1",
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"})
    if block.page == "docs/quickstart.md":  # "after the demo": the default store exists
        from spoolctl.store import Store

        Store.open(str(cwd / ".cache" / "spoolctl" / "store"), create=True).close()
    if block.lang == "python":
        script = cwd / "snippet.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    else:
        code, pip = shell_commands(Block(block.page, block.line, block.lang, code, None))
        for line in pip:
            check_pip(line)
        if not code.strip():
            return
        argv = ["bash", "-euo", "pipefail", "-c", code]
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, (f"{block.id} failed (exit {proc.returncode}):\n"
                                  f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
