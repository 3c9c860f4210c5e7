"""Every Python and shell block of the docs runs, on CPU, with tiny local models.

A reader copies these blocks; a block that fails as written is a bug. Rules:

* Pages covered: ``PAGES``, every page under ``docs/`` and the README (a new page is
  covered without being listed). ``docs/cli.md`` is generated from ``--help`` and has no
  blocks to copy; its ``Example:`` lines are what a reader runs, so they run too, in order,
  in one world (``test_cli_reference_examples_run``).
* Blocks: fenced ```` ```python ````, ```` ```bash ````, ```` ```sh ```` and
  ```` ```console ```` (its ``$ `` lines). Python blocks run with the test interpreter, shell
  blocks with ``bash -euo pipefail``; both in a fresh directory with ``HOME`` there (so
  ``~/.cache/spoolctl/store`` is private), the test venv's ``bin`` first on ``PATH`` (as for a
  user who installed spoolctl) and ``.venv`` linked to it (as after ``scripts/run.sh``).
* One test per page (``test_doc_page_runs``): its blocks run top to bottom in one fresh
  directory, as a reader follows the page; each must exit 0, a one-command block with
  ``--json`` (or a benchmark script) must print one JSON document, and ``AFTER`` checks what
  a page claims beyond that (the transfer page: the old host's entries land on the new one).
  The tiny models are built once per session (``tiny_chat_model_dir``) or per module.
* Benchmark commands run at smoke sizes (``SCALED``; the page's sizes take minutes to hours);
  the command a reader copies must still be on the page.
* Placeholder paths a reader replaces with their own are mapped (``placeholders``):
  ``/models/llama`` is the tiny Llama with a chat template (PyTorch and mlx-lm load it),
  ``/models/qwen2-vl-2b`` a tiny Qwen2-VL, ``/var/cache/...``, ``/var/lib/...``, ``/data/...``,
  ``/nvme/...``, ``/nvme0/...``, ``/nvme1/...``, ``/backup/...`` and ``/path/on/the/nvme``
  live in the fresh directory, where ``chart.png``,
  ``manual.txt`` and ``prompts.jsonl`` exist; ``http://127.0.0.1:8000`` is a small local
  stand-in for a vLLM server's OpenAI API (``prefill --server`` runs against it for real).
  What a page assumes already exists is there (``seed``): the default store with entries
  and a quarantined item, a vLLM connector root with a two-rank deployment where a block
  names ``/var/cache/spoolctl/vllm`` or ``/nvme/spool`` (and one per drive for
  ``/nvme0/spool``, ``/nvme1/spool``).
* Commands a reader runs elsewhere are shimmed, not faked: ``ssh HOST CMD`` runs CMD here
  with the fresh directory's paths moved under ``hosts/HOST/`` (another host's disk), and
  ``sudo [-u USER]`` runs the command as this user (an ``install -o/-g`` owner becomes
  this user).
* ``pip install`` lines are checked, not run (CI has no business installing from PyPI): every
  extra they name exists in ``pyproject.toml`` and every ``==`` pin equals
  ``scripts/constraints.txt``.
* Blocks included from ``examples/`` (``--8<--``) run in ``tests/project/test_examples.py``.
* Opt-out: ``<!-- snippet: skip: REASON -->`` on the line before the fence, for a block that
  cannot run here (it starts a server, needs a key and the network, installs system
  services, or is the test suite itself). ``test_opt_outs_are_few_and_say_why`` lists
  them; keep it short. A block that needs a tool this machine may lack (mlx, promtool)
  is skipped with that reason where it is missing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI, prompt_tokens
from testpaths import REPO_DIR

REPO = REPO_DIR
CLI_PAGE = "docs/cli.md"
PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md")
                              if str(p.relative_to(REPO)) != CLI_PAGE)]
LANGS = {"python", "bash", "sh", "console"}
SKIP = re.compile(r"^\s*<!--\s*snippet:\s*skip:\s*(?P<reason>.+?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)\s*$")
#: Known opt-outs (page, reason start): a new one must be added here on purpose.
OPT_OUTS = {
    ("README.md", "builds .venv and runs the whole test suite"),
    ("docs/quickstart.md", "builds .venv and runs the whole test suite"),
    ("docs/install.md", "starts a vLLM server on a real model"),
    ("docs/install.md", "builds the sdist and wheel"),
    ("docs/install.md", "starts a web server (mkdocs serve)"),
    ("docs/controllers.md", "talks to the Gemini API"),
    ("docs/connector.md", "starts a vLLM server on a real model"),
    ("docs/operations.md", "installs systemd units"),
    ("docs/benchmarks-vllm.md", "starts vLLM engines on generated models"),
    ("docs/benchmarks-vllm.md", "the first line needs a CUDA device"),
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
    # every listed opt-out is still used (none stale); one may cover blocks whose reasons
    # name different tests after the same cause
    used = {(p, r) for p, r in OPT_OUTS
            if any(page == p and reason.startswith(r) for page, reason in found)}
    assert used == OPT_OUTS and len(OPT_OUTS) <= 10


# -- running ---------------------------------------------------------------------------------

DEPLOYMENT = "vllm-v1-" + "d0c5" * 12  # a connector deployment directory the pages' roots hold
VLLM_URL = "http://127.0.0.1:8000"


def fake_vllm() -> FakeOpenAI:
    """A small stand-in for a vLLM server's OpenAI API answering with the usage vLLM
    reports, so ``prefill --server`` blocks run for real. (tests/connector/test_prefill_server.py
    runs it against real vLLM.)"""
    return FakeOpenAI(lambda body, _attempt: (200, {"choices": [{"text": "x"}], "usage": {
        "prompt_tokens": prompt_tokens(body), "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 0}}}), models=("/models/llama",))


SUDO = r"""#!/usr/bin/env bash
# docs test shim: run the command as this user (the pages' `sudo -u vllm ...`)
while [[ $# -gt 0 && "$1" == -* ]]; do
  case "$1" in -u|-g) shift 2 ;; *) shift ;; esac
done
if [[ "${1:-}" == install ]]; then  # `install -o vllm -g vllm`: this user owns it here
  args=()
  while [[ $# -gt 0 ]]; do
    case "$1" in -o) args+=(-o "$(id -un)"); shift 2 ;; -g) args+=(-g "$(id -gn)"); shift 2 ;;
                 *) args+=("$1"); shift ;; esac
  done
  set -- "${args[@]}"
fi
exec "$@"
"""
SSH = r"""#!/usr/bin/env bash
# docs test shim: `ssh HOST CMD` runs CMD here, the work dir's paths moved to HOST's disk
host="$1"; shift
cmd="$*"
exec bash -c "${cmd//$SNIPPET_WORK\//$SNIPPET_WORK/hosts/$host/}"
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_chat_model_dir) -> dict[str, Path | str]:
    """What the placeholders point at: models, a picture, a fake vLLM server, the shims."""
    out: dict[str, Path | str] = {"llama": tiny_chat_model_dir}
    shims = tmp_path_factory.mktemp("shims")
    for name, text in (("sudo", SUDO), ("ssh", SSH)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    out["shims"] = shims
    try:
        import mlx_vlm  # noqa: F401
        from PIL import Image

        from spoolctl.demo.tinyvlm import build_tiny_vlm

        out["vlm"] = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl")
        picture = tmp_path_factory.mktemp("pictures") / "chart.png"
        img = Image.new("RGB", (56, 56), (255, 255, 255))
        img.paste(Image.new("RGB", (28, 28), (20, 20, 220)), (14, 14))
        img.save(picture)
        out["picture"] = picture
    except ImportError:
        pass
    server = fake_vllm()
    out["vllm_url"] = server.url
    yield out
    server.close()


def placeholders(world: dict, cwd: Path) -> list[tuple[str, str]]:
    """(placeholder, replacement), longest first."""
    pairs = [("/models/llama", str(world["llama"])), ("/var/cache/", f"{cwd}/var/cache/"),
             ("/var/lib/", f"{cwd}/var/lib/"), ("/data/", f"{cwd}/data/"),
             ("/nvme/", f"{cwd}/nvme/"), ("/path/on/the/nvme", f"{cwd}/nvme/bench"),
             ("/nvme0/", f"{cwd}/nvme0/"), ("/nvme1/", f"{cwd}/nvme1/"),
             ("/backup/", f"{cwd}/backup/"),
             (VLLM_URL, str(world["vllm_url"]))]
    if "vlm" in world:
        pairs.append(("/models/qwen2-vl-2b", str(world["vlm"])))
    return sorted(pairs, key=lambda p: -len(p[0]))


def needs(block: Block, world: dict) -> str | None:
    """Why a block cannot run in this environment (a missing optional tool), or None."""
    if ".venv/" in block.code and not (Path(sys.prefix) / "bin" / "activate").exists():
        return "the tests do not run in a virtualenv (the page's .venv)"
    if "qwen2-vl" in block.code and "vlm" not in world:
        return "mlx-vlm is not installed here"
    if re.search(r"\bmlx\b|Mlx", block.code):
        try:
            import mlx.core  # noqa: F401
        except ImportError:
            return "mlx is not installed here"
    if re.search(r"^\s*promtool\b", block.code, re.M) and shutil.which("promtool") is None:
        return "promtool is not installed here (scripts/check_examples.sh checks the rules)"
    return None


def _fill(root: Path, n: int, *, kind: str = "pytorch", namespace: str = "ns",
          released: int = 0, first: int = 0) -> list[str]:
    from spoolctl.store import Store

    ids = []
    with Store.open(root, create=True) as store:
        for i in range(n):
            ids.append(store.put(kind=kind, namespace=namespace, key=f"{first + i:064x}",
                                 objects={"kv": os.urandom(4096 + i)}).entry_id)
        for entry_id in ids[:released]:
            store.release(entry_id)
    return ids


def _connector_root(base: Path, *, first: int = 0) -> None:
    """A vLLM connector base root: one deployment, two ranks, the same chunks on both (keys
    ``first``, ``first + 1``, ...; the first one released)."""
    for rank in (0, 1):
        _fill(base / DEPLOYMENT / f"rank-{rank:04d}", 4, kind="vllm",
              namespace=f"vllm-v1-ns-rank{rank}", released=1, first=first)


def seed(cwd: Path, code: str) -> dict[str, str]:
    """Create what a page assumes exists; return id placeholders and their real values
    (``3fa9c2d1`` -> an entry of the default store, a quarantine item id -> a real one)."""
    from spoolctl.store import QuarantineReason, Store

    for d in ("data", "var/cache", "var/lib/node_exporter/textfile", "nvme/bench"):
        (cwd / d).mkdir(parents=True, exist_ok=True)
    for name in ("scripts", "examples"):
        (cwd / name).symlink_to(REPO / name, target_is_directory=True)
    (cwd / "manual.txt").write_text("The manual. " * 40)
    (cwd / "prompts.jsonl").write_text('"The manual says"\n[1, 2, 3, 4]\n'
                                       '{"prompt": "Hello there", "cache_salt": "tenant-1", '
                                       '"name": "manual"}\n')
    default = cwd / ".cache" / "spoolctl" / "store"
    ids = _fill(default, 6, released=2)
    with Store.open(default) as store:
        item = store.quarantine_entry(ids[-1], QuarantineReason.PAYLOAD_DIGEST,
                                      "seeded by the docs test").name
    if "/var/cache/spoolctl/vllm" in code:
        _connector_root(cwd / "var" / "cache" / "spoolctl" / "vllm")
    if "/nvme/spool" in code:
        _connector_root(cwd / "nvme" / "spool")
    for drive in ("nvme0", "nvme1"):  # a host's several drives (decisions 2712, 2713)
        if f"/{drive}/spool" in code:
            _connector_root(cwd / drive / "spool", first=100 * int(drive[-1]))
    if "ssh old-host" in code:  # other chunks than this host's, so an import shows
        _connector_root(cwd / "hosts" / "old-host" / "nvme" / "spool", first=100)
    return {"3fa9c2d1": ids[2][:8], "20260101T120000Z-payload_digest-1a2b3c4d": item}


def run_code(lang: str, code: str, world: dict, cwd: Path) -> subprocess.CompletedProcess:
    """Run one block's code (placeholders already mapped) in ``cwd`` as a reader would."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOOLCTL_")}
    env.update({"HOME": str(cwd), "XDG_CACHE_HOME": str(cwd / ".cache"), "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "NO_COLOR": "1", "SNIPPET_WORK": str(cwd),
                "PATH": os.pathsep.join([str(world["shims"]), str(Path(sys.executable).parent),
                                         env.get("PATH", "")])})
    if lang == "python":
        script = cwd / "snippet.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", code]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)


def fresh_dir(tmp_path: Path, world: dict, codes: list[str]) -> tuple[Path, list[str]]:
    """A fresh work dir with the world a page assumes; ``codes`` with placeholders mapped."""
    cwd = tmp_path / "work"
    cwd.mkdir()
    (cwd / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    if "picture" in world:
        (cwd / "data").mkdir()
        for dest in (cwd / "chart.png", cwd / "data" / "chart.png"):
            dest.write_bytes(Path(world["picture"]).read_bytes())
    pairs = dict(placeholders(world, cwd))
    # One pass: a replacement (under cwd) must not be mapped again by a shorter placeholder.
    pattern = re.compile("|".join(re.escape(p) for p in pairs))
    mapped = [pattern.sub(lambda m: pairs[m[0]], code) for code in codes]
    ids = seed(cwd, "\n".join(mapped))
    return cwd, [_ids(code, ids) for code in mapped]


def _ids(code: str, ids: dict[str, str]) -> str:
    for placeholder, real in ids.items():
        code = code.replace(placeholder, real)
    return code


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


#: Benchmark commands run at smoke sizes: the page's sizes take minutes to hours and belong on
#: a quiet host. The command a reader copies must still be on the page (checked below), and
#: the scaled run must print the JSON report the page describes.
SCALED = {
    "python scripts/bench_store.py --dir /path/on/the/nvme --repeat 7":
        "python scripts/bench_store.py --dir /path/on/the/nvme --repeat 1 --sizes 1",
    "python scripts/bench_store.py --floor --sizes 1 --batch-sizes 256 --repeat 10":
        "python scripts/bench_store.py --floor --sizes 1 --batch-sizes 64 --repeat 1",
    "python scripts/bench_controllers.py --tokens 4096 --repeat 2":
        "python scripts/bench_controllers.py --tokens 256 --repeat 1 --preset tiny",
    "python scripts/bench_cli.py --entries 1000000":
        "python scripts/bench_cli.py --entries 1500 --released 150 --small 1200 --dir .",
    "python scripts/bench_rebuild.py --entries 20000 --repeat 3":
        "python scripts/bench_rebuild.py --entries 300 --repeat 1 --dir .",
    # 166 s at the page's sizes on an idle 2-core host: the longest test of the default run
    "python scripts/bench_import_check.py --tokens 512 2048 --repeat 1":
        "python scripts/bench_import_check.py --tokens 128 --repeat 1",
}


def test_scaled_commands_are_still_on_the_pages():
    text = "\n".join(b.code for b in ALL if b.skip is None)
    for command in SCALED:
        assert command in text, f"SCALED names a command no page has any more: {command}"


def commands(code: str) -> list[str]:
    """The shell commands of a block: continuation lines joined, comments and blanks gone."""
    out = []
    for line in re.sub(r"\\\n\s*", " ", code).splitlines():
        bare = line.split(" #", 1)[0].strip()
        if bare and not bare.startswith("#"):
            out.append(bare)
    return out


def check_claims(block: Block, code: str, proc: subprocess.CompletedProcess) -> None:
    """What the text says a one-command block prints: ``--json`` and the benchmark scripts
    print one JSON document on stdout."""
    if block.lang == "python":
        return
    cmds = commands(code)
    if len(cmds) == 1 and ("--json" in cmds[0].split() or "scripts/bench_" in cmds[0]):
        try:
            json.loads(proc.stdout)
        except ValueError as e:
            pytest.fail(f"{block.id}: `{cmds[0]}` did not print one JSON document ({e}):\n"
                        f"{proc.stdout[-2000:]}")


def check_transfer(cwd: Path) -> None:
    """docs/transfer.md: every rank store of the old host's root lands in the same place on
    the new host: each entry the old host still serves (not released) is there after."""
    from spoolctl.store import Store

    old_base = cwd / "hosts" / "old-host" / "nvme" / "spool" / DEPLOYMENT
    new_base = cwd / "nvme" / "spool" / DEPLOYMENT
    for rank in (0, 1):
        with Store.open(old_base / f"rank-{rank:04d}") as store:
            served = {(r.namespace, r.key) for r in store.entries()
                      if r.state == "committed" and r.hint != "release"}
        with Store.open(new_base / f"rank-{rank:04d}") as store:
            landed = {(r.namespace, r.key) for r in store.entries() if r.state == "committed"}
        assert len(served) == 3 and served <= landed, f"rank {rank}: {served - landed} missing"


#: After-checks of what a page claims, beyond exit 0: (page, block line) -> check(cwd).
AFTER = {("docs/transfer.md", 8): check_transfer}
RUNNABLE_PAGES = sorted({b.page for b in ALL if b.skip is None})


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_doc_page_runs(page: str, world, tmp_path: Path) -> None:
    """A page's runnable blocks run top to bottom in one fresh directory, as a reader who
    follows the page; each exits 0 and prints what its text claims."""
    todo: list[tuple[Block, str]] = []
    missing: set[str] = set()
    for block in (b for b in ALL if b.page == page and b.skip is None):
        code = block.code
        if block.lang != "python":
            code, pip = shell_commands(block)
            for line in pip:
                check_pip(line)
        for command, scaled in SCALED.items():
            code = code.replace(command, scaled)
        if not code.strip():
            continue  # only pip lines: checked above
        if why := needs(block, world):
            missing.add(why)
        else:
            todo.append((block, code))
    if missing and not todo:
        pytest.skip("; ".join(sorted(missing)))
    if not todo:
        return
    cwd, mapped = fresh_dir(tmp_path, world, [code for _b, code in todo])
    for (block, _code), code in zip(todo, mapped, strict=True):
        proc = run_code(block.lang, code, world, cwd)
        assert proc.returncode == 0, (f"{block.id} failed (exit {proc.returncode}):\n"
                                      f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        check_claims(block, code, proc)
        if (check := AFTER.get((block.page, block.line))) is not None:
            check(cwd)


# -- the CLI reference's examples ----------------------------------------------------------

EXAMPLE = re.compile(r"^Example(?: \([^)]*\))?: `(?P<cmd>[^`]+)`$")
#: Examples of docs/cli.md that cannot run here, and why (keep it short).
CLI_SKIPS = {"vllm serve": "starts a vLLM server on a real model (tests/test_operator_examples"
                           ".py serves with the root of `spoolctl config vllm`)",
             # The keys commands change an encrypted store's keys: they need its master key,
             # which the docs world has none of (tests/store/test_tenant_keys.py runs each
             # with one).
             "spoolctl keys rotate": "needs the store's master key",
             "spoolctl keys revoke": "needs the store's master key",
             "spoolctl keys retire": "needs the store's master key"}


def cli_examples() -> list[tuple[int, str]]:
    lines = (REPO / CLI_PAGE).read_text().splitlines()
    return [(n + 1, m["cmd"]) for n, line in enumerate(lines) if (m := EXAMPLE.match(line))]


def test_cli_reference_examples_run(world, tmp_path: Path) -> None:
    """Every ``Example:`` of the generated CLI reference runs, in page order, in one world
    (``init`` first creates the store the next examples use); each exits 0."""
    examples = cli_examples()
    assert len(examples) >= 15, "the CLI reference lost its examples"
    runnable = [(n, cmd) for n, cmd in examples
                if not any(cmd.startswith(prefix) for prefix in CLI_SKIPS)]
    assert len(examples) - len(runnable) <= len(CLI_SKIPS)
    cwd, script = fresh_dir(tmp_path, world, [cmd for _n, cmd in runnable])
    for (n, _cmd), cmd in zip(runnable, script, strict=True):
        proc = run_code("bash", cmd, world, cwd)
        assert proc.returncode == 0, (f"{CLI_PAGE}:{n} `{cmd}` failed (exit "
                                      f"{proc.returncode}):\n{proc.stdout[-2000:]}\n"
                                      f"{proc.stderr[-3000:]}")
