"""The documentation site: generated CLI reference, runbook coverage, strict build, CLI polish.

What a reader relies on: the CLI reference is the app's real command tree (never stale);
the runbook explains every metric, alert, doctor finding and quarantine reason that exists
in the code; every connector option is documented; the site builds with ``--strict``; and
the CLI itself behaves as documented (examples in every ``--help``, bare ``spoolctl`` =
status, no colors off a terminal or with ``NO_COLOR``, IEC sizes, relative times).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest
from testpaths import REPO_DIR

REPO = REPO_DIR
DOCS = REPO / "docs"
ANSI_COLOR = re.compile(r"\x1b\[(?:[0-9;]*;)?(?:3[0-79]|4[0-79]|9[0-7]|10[0-7]|38;|48;)[0-9;]*m")
ANSI_ANY = re.compile(r"\x1b\[[0-9;]*m")


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _spoolctl_bin() -> str:
    exe = Path(sys.executable).with_name("spoolctl")
    if not exe.exists():
        pytest.skip("the spoolctl console script is not installed next to this interpreter")
    return str(exe)


def _run(args: list[str], *, env: dict[str, str] | None = None,
         cwd: Path | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    full_env.update({"COLUMNS": "120", **(env or {})})
    return subprocess.run([_spoolctl_bin(), *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=120)


def _command_tree():
    import typer.main

    from spoolctl.cli.app import app

    root = typer.main.get_command(app)
    out = []

    def walk(cmd, path):
        out.append((path, cmd))
        for name, sub in getattr(cmd, "commands", {}).items():
            if not getattr(sub, "hidden", False):
                walk(sub, [*path, name])

    walk(root, ["spoolctl"])
    return out


# -- CLI reference ------------------------------------------------------------------------


def test_cli_reference_is_current_with_the_typer_app() -> None:
    gen = _load_script("gen_cli_docs")
    committed = (DOCS / "cli.md").read_text()
    assert committed == gen.render(), (
        "docs/cli.md differs from the typer app: run `python scripts/gen_cli_docs.py`")


def test_cli_reference_documents_every_command_and_option() -> None:
    text = (DOCS / "cli.md").read_text()
    for path, cmd in _command_tree():
        assert f"`{' '.join(path)}`" in text, f"{' '.join(path)} missing from docs/cli.md"
        for param in cmd.params:
            if getattr(param, "hidden", False):
                continue
            for opt in param.opts:
                if opt.startswith("-"):
                    assert opt in text, f"{opt} of {' '.join(path)} missing from docs/cli.md"


def test_help_of_every_command_shows_an_example() -> None:
    missing = [" ".join(path) for path, cmd in _command_tree()
               if not hasattr(cmd, "commands") and "Example" not in (cmd.help or "")]
    assert not missing, f"--help without an example: {missing}"


def test_rich_markup_becomes_markdown() -> None:
    gen = _load_script("gen_cli_docs")
    text = gen.markdown_help("Do it.\n\nExample: [bold]spoolctl x --root\n    /a[/bold]")
    assert text == "Do it.\n\nExample: `spoolctl x --root /a`"


# -- runbook coverage ---------------------------------------------------------------------


def _runbook() -> str:
    return "\n".join(p.read_text() for p in sorted(DOCS.glob("runbook*.md")))


def test_runbook_explains_every_metric() -> None:
    from spoolctl.metrics import ALL_METRICS

    text = _runbook()
    missing = [spec.name for spec in ALL_METRICS if f"`{spec.name}" not in text]
    assert not missing, f"metrics missing from docs/runbook.md: {missing}"


def test_runbook_explains_every_label_value() -> None:
    from spoolctl.metrics import LABEL_VALUES

    text = _runbook()
    missing = {label: sorted(v for v in values if f"`{v}`" not in text)
               for label, values in LABEL_VALUES.items()}
    assert not any(missing.values()), f"label values missing from the runbook: {missing}"


def test_runbook_has_a_section_for_every_alert() -> None:
    yaml = pytest.importorskip("yaml")
    rules = yaml.safe_load((REPO / "examples/prometheus/spoolctl-alerts.yml").read_text())
    alerts = [r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r]
    headings = set(re.findall(r"^### (\S+)\s*$", _runbook(), flags=re.M))
    assert alerts and not [a for a in alerts if a not in headings]
    for group in rules["groups"]:
        for rule in group["rules"]:
            # the alert's own pointer leads to that section
            assert f"runbook.md#{rule['alert'].lower()}" in rule["annotations"]["description"]


def _doctor_check_names(tmp_path: Path) -> set[str]:
    """Every check name doctor.py can emit: literals in the source + a live run's names."""
    from spoolctl.store import Store
    from spoolctl.store.maintain import doctor

    source = Path(doctor.__file__).read_text()
    names = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Check"
                and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(node.args[0].value)
    root = tmp_path / "store"
    Store.open(str(root), create=True).close()
    names |= {c.name for c in doctor.run_checks(root)}
    # sqlite.{name} is built from the list of state databases it checks
    names |= {f"sqlite.{n}" for n in re.findall(r'"(\w+\.sqlite3)"', source)}
    return names


def test_runbook_explains_every_doctor_finding(tmp_path: Path) -> None:
    names = _doctor_check_names(tmp_path)
    assert {"root.marker", "fs.fsync", "sqlite.catalog.sqlite3"} <= names
    text = _runbook()
    missing = sorted(n for n in names if f"| `{n}` |" not in text)
    assert not missing, f"doctor checks missing from the runbook table: {missing}"


def test_runbook_explains_every_quarantine_reason() -> None:
    from spoolctl.errors import QuarantineReason

    text = _runbook()
    missing = [r.value for r in QuarantineReason if f"| `{r.value}` |" not in text]
    assert not missing, f"quarantine reasons missing from the runbook: {missing}"


def test_connector_guide_documents_every_option() -> None:
    from spoolctl.connector.deployment.settings import KNOWN_KEYS

    text = (DOCS / "connector.md").read_text()
    assert not [k for k in KNOWN_KEYS if f"`{k}`" not in text]


# -- site build ---------------------------------------------------------------------------


def test_every_page_is_in_the_nav() -> None:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())

    def pages(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from pages(item)
        elif isinstance(node, dict):
            for value in node.values():
                yield from pages(value)

    nav = set(pages(config["nav"]))
    on_disk = {p.name for p in DOCS.glob("*.md")}
    assert on_disk == nav, f"not in nav: {on_disk - nav}; missing files: {nav - on_disk}"


def test_decision_index_is_grouped_and_notes_changed_records(tmp_path: Path) -> None:
    gen = _load_script("gen_decisions_index")
    (tmp_path / "0601-b.md").write_text("# 0601 — Second\n\nStatus: superseded by 0900\n")
    (tmp_path / "0600-a.md").write_text("intro\n# 0600 — First [x]\n\nStatus: accepted\n")
    (tmp_path / "0001-c.md").write_text("# 0001 — Third\n\nStatus: accepted\n")
    (tmp_path / "notes.md").write_text("# not a record\n")
    assert gen.index(tmp_path) == (
        "### Store format and commit\n\n- [0001 — Third](decisions/0001-c.md)\n\n"
        "### Docs and packaging\n\n- [0600 — First \\[x\\]](decisions/0600-a.md)\n"
        "- [0601 — Second](decisions/0601-b.md) (superseded)")


def test_decision_index_on_the_page_is_current() -> None:
    """Issue 36.8: the index is in docs/decisions.md itself (the repository view showed an
    empty page: it was filled only at site build)."""
    gen = _load_script("gen_decisions_index")
    assert gen.OUTPUT.read_text(encoding="utf-8") == gen.render(), \
        "run `python scripts/gen_decisions_index.py`"
    for path in sorted((DOCS / "decisions").glob("[0-9]*.md")):
        assert f"(decisions/{path.name})" in gen.OUTPUT.read_text(encoding="utf-8")


def test_every_decision_record_has_a_status_line() -> None:
    for path in sorted((DOCS / "decisions").glob("[0-9]*.md")):
        head = path.read_text(encoding="utf-8").splitlines()[:6]
        assert any(line.startswith("Status: ") for line in head), \
            f"{path.name}: add a 'Status: accepted' (or superseded/amended) line under the title"


def test_user_facing_pages_cite_no_internal_issue_numbers() -> None:
    """Readers cannot follow "issue 22": pages cite decisions, tests and sections instead
    (decision records may name the issue that prompted them)."""
    pages = [REPO / "README.md", *sorted(DOCS.glob("*.md")),
             *sorted((REPO / "examples").rglob("*")), *sorted((REPO / "spoolctl" / "cli")
                                                             .glob("*.py"))]
    cite = re.compile(r"\bissues? #?\d+|\(#\d+\)", re.IGNORECASE)
    for page in pages:
        if page.is_file():
            for n, line in enumerate(page.read_text(errors="replace").splitlines(), 1):
                assert not cite.search(line), f"{page.relative_to(REPO)}:{n}: {line.strip()}"


def test_store_api_page_names_every_public_name() -> None:
    """Issue 36.8: the Store API has a reference page (the README pointed into
    spoolctl/store/__init__.py), and it keeps up with ``spoolctl.store.__all__``."""
    import spoolctl.store as store

    page = (DOCS / "store-api.md").read_text(encoding="utf-8")
    missing = [name for name in store.__all__ if f"`{name}" not in page]
    assert not missing, f"docs/store-api.md does not name {missing}"
    for method in ("put", "put_many", "lookup", "read", "release", "clean", "facts",
                   "set_max_bytes", "restore_quarantined"):
        assert callable(getattr(store.Store, method)) and f"`{method}(" in page


def test_site_builds_with_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="docs extra not installed (scripts/check_docs.sh)")
    pytest.importorskip("material", reason="docs extra not installed (scripts/check_docs.sh)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "s")],
        cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runbook = (tmp_path / "s" / "runbook" / "index.html").read_text()
    assert 'id="spoolctlstorenearmax"' in runbook
    operations = (tmp_path / "s" / "operations" / "index.html").read_text()
    assert "OnUnitActiveSec" in operations  # example files are included, not copied


# -- CLI polish ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def populated_root(tmp_path_factory) -> Path:
    from spoolctl.store import Store

    root = tmp_path_factory.mktemp("docs-cli") / "store"
    with Store.open(str(root), create=True, max_bytes=1 << 30) as store:
        store.put(kind="pytorch", namespace="docs-test", key="k1",
                  objects={"kv": b"x" * 3000})
    return root


def test_bare_spoolctl_shows_the_status_of_the_default_root(populated_root: Path) -> None:
    env = {"SPOOLCTL_ROOT": str(populated_root)}
    bare, status = _run([], env=env), _run(["status"], env=env)
    assert bare.returncode == 0, bare.stderr
    assert bare.stdout == status.stdout
    assert str(populated_root) in bare.stdout


def test_no_colors_when_stdout_is_not_a_terminal(populated_root: Path) -> None:
    proc = _run(["doctor", "--root", str(populated_root)])
    assert proc.returncode == 0, proc.stderr
    assert "fs.fsync" in proc.stdout and not ANSI_ANY.search(proc.stdout)


def _run_in_pty(args: list[str], env: dict[str, str]) -> str:
    """Run spoolctl with a pseudo-terminal as stdout (what an operator's shell gives it)."""
    master, slave = os.openpty()
    full_env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    full_env.update({"COLUMNS": "120", "TERM": "xterm-256color", **env})
    proc = subprocess.Popen([_spoolctl_bin(), *args], stdout=slave, stderr=subprocess.PIPE,
                            env=full_env)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=60)
    os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_colors_on_a_terminal_and_off_with_no_color(populated_root: Path) -> None:
    colored = _run_in_pty(["doctor", "--root", str(populated_root)], {})
    assert "fs.fsync" in colored and ANSI_COLOR.search(colored), "expected colors on a TTY"
    plain = _run_in_pty(["doctor", "--root", str(populated_root)], {"NO_COLOR": "1"})
    assert "fs.fsync" in plain and not ANSI_COLOR.search(plain)


def test_sizes_are_iec_and_times_are_relative(populated_root: Path) -> None:
    env = {"SPOOLCTL_ROOT": str(populated_root)}
    status, ls = _run(["status"], env=env), _run(["ls"], env=env)
    assert status.returncode == 0 and ls.returncode == 0, status.stderr + ls.stderr
    text = status.stdout + ls.stdout
    assert "KiB" in text and "GiB" in text  # 3,000-byte entry, 1 GiB max
    assert not re.search(r"\d\s?(KB|MB|GB|TB)\b", text), "decimal units in human output"
    assert re.search(r"\b\d+s ago\b", ls.stdout), ls.stdout


def test_architecture_module_map_is_current() -> None:
    """docs/architecture.md's module map is the code's: a module added, moved, removed or
    re-described without regenerating the page fails here."""
    gen = _load_script("gen_architecture")
    assert gen.OUTPUT.read_text(encoding="utf-8") == gen.render(), \
        "run `python scripts/gen_architecture.py`"


def test_architecture_names_only_paths_that_exist() -> None:
    """Every module or folder the architecture page names in its prose exists."""
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(spoolctl/[\w/]+(?:\.py)?/?)`", text))
    assert len(named) > 20
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
