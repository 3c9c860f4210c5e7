"""Issue 28.1 / decision 2500: one scanner of roots. The library (``places.inspect_root``:
export, import, the peer API) and the CLI (``spoolctl status --root``, like every command)
classify the same odd roots the same way, and the ``rank-NNNN`` parser is ASCII only."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from operator_cli import run

from spoolctl.connector.deployment.topology import rank_of_dirname
from spoolctl.errors import ArchiveError
from spoolctl.metrics import TARGET_LABELS
from spoolctl.store import ConfigError, RootError, Store
from spoolctl.store.disk.root import StorePaths, ensure_layout
from spoolctl.store.format.rankdirs import parse_rank_dirname, rank_dirname
from spoolctl.store.transfer.archive import validate_place
from spoolctl.store.transfer.places import inspect_root

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

DEP = "vllm-v1-" + "c3" * 24
ARABIC_1234 = "rank-\u0661\u0662\u0663\u0664"


def _store(path: Path) -> None:
    Store.open(path, create=True).close()


def _store_once(cache: dict[str, Path], root: Path) -> Callable[[Path], None]:
    """Make a store at a path by copying one made once (a store per case is slow)."""
    def make(path: Path) -> None:
        if "proto" not in cache:
            cache["proto"] = root / ".proto"
            _store(cache["proto"])
        shutil.copytree(cache["proto"], path, symlinks=True)
    return make


def _base_with_stray_file(d: Path, mk) -> None:
    mk(d / DEP / "rank-0000")
    (d / "README").write_text("cache for the vLLM fleet\n")


def _base_with_lost_found(d: Path, mk) -> None:
    mk(d / DEP / "rank-0000")
    (d / "lost+found").mkdir()
    (d / "lost+found" / "#1234").write_text("x")


def _rank_without_marker(d: Path, mk) -> None:
    mk(d / "rank-0000")
    (d / "rank-0002").mkdir()  # its marker lost, or an interrupted first open


def _non_ascii_rank(d: Path, mk) -> None:
    mk(d / "rank-0000")
    mk(d / ARABIC_1234)


def _newline_rank(d: Path, mk) -> None:
    mk(d / "rank-0000")
    mk(d / "rank-0001\n")


def _only_non_ascii_rank(d: Path, mk) -> None:
    mk(d / ARABIC_1234)


def _symlinked_rank(d: Path, mk) -> None:
    mk(d / "rank-0000")
    mk(d.parent / "elsewhere")
    os.symlink(d.parent / "elsewhere", d / "rank-0001")


def _unfinished_init(d: Path, mk) -> None:
    ensure_layout(StorePaths(d))  # what init makes before its marker


def _empty_subdirs(d: Path, mk) -> None:
    (d / "a").mkdir()
    (d / "b").mkdir()


def _odd_deployment_name(d: Path, mk) -> None:
    mk(d / "my deployment" / "rank-0000")


def _junk(d: Path, mk) -> None:
    (d / "notes.txt").write_text("x")


def _file(d: Path, mk) -> None:
    d.rmdir()
    d.write_text("x")


# name -> (how to make it, expected kind, expected stores as (path under it, rank, deployment))
CASES: dict[str, tuple[Callable, str, list[tuple[str, int | None, str | None]]]] = {
    "base root with a stray file": (_base_with_stray_file, "base",
                                    [(f"{DEP}/rank-0000", 0, DEP)]),
    "base root on a mount point (lost+found)": (_base_with_lost_found, "base",
                                                [(f"{DEP}/rank-0000", 0, DEP)]),
    "rank-NNNN folder without a marker": (_rank_without_marker, "deployment",
                                          [("rank-0000", 0, "x"), ("rank-0002", 2, "x")]),
    "non-ASCII digits are no rank": (_non_ascii_rank, "deployment", [("rank-0000", 0, "x")]),
    "a trailing newline is no rank": (_newline_rank, "deployment", [("rank-0000", 0, "x")]),
    "only a non-ASCII rank": (_only_non_ascii_rank, "error", []),
    "symlinked rank is not followed": (_symlinked_rank, "deployment", [("rank-0000", 0, "x")]),
    "unfinished init is a store": (_unfinished_init, "store", [("", None, None)]),
    "nothing but empty directories": (_empty_subdirs, "empty", []),
    "deployment name with a space": (_odd_deployment_name, "base",
                                     [("my deployment/rank-0000", 0, "my deployment")]),
    "a stray file only": (_junk, "error", []),
    "a file": (_file, "error", []),
}


def _library(path: Path) -> tuple[str, list]:
    try:
        found = inspect_root(path)
    except RootError:
        return "error", []
    return found.kind, [(s.path, s.rank, s.deployment) for s in found.stores]


_NOT_A_ROOT = ("not a spoolctl store, vLLM deployment directory or base root",
               "not a directory")


def _cli(path: Path) -> tuple[str, list]:
    """What ``spoolctl status --json --root PATH`` took the root for."""
    code, out, _err = run("status", "--root", str(path), "--json")
    doc = json.loads(out)
    if doc.get("ok") is False:  # refused as a root, or one store that failed to open
        assert code == 2, doc
        if doc["error"]["message"].startswith(_NOT_A_ROOT):
            return "error", []
        return "store", [(Path(doc["error"]["path"]), None, None)]
    if "stores" in doc and "kind" in doc:
        return doc["kind"], [(Path(s["root"]), s["rank"], s["deployment"])
                             for s in doc["stores"]]
    return "store", [(Path(doc["root"]), None, None)]


def test_cli_and_library_classify_odd_roots_the_same(tmp_path: Path) -> None:
    base = Path(os.path.realpath(tmp_path))
    mk = _store_once({}, base)
    for i, (name, (make, kind, stores)) in enumerate(CASES.items()):
        root = base / f"case{i}" / "x"
        root.mkdir(parents=True)
        make(root, mk)
        want = (kind, [(root / rel if rel else root, rank,
                        None if dep is None else root.name if dep == "x" else dep)
                       for rel, rank, dep in stores])
        assert _library(root) == want, name
        assert _cli(root) == want, name


def test_rank_directory_names_are_ascii_and_whole() -> None:
    assert parse_rank_dirname("rank-0042") == 42 == rank_of_dirname("rank-0042")
    for name in (ARABIC_1234, "rank-0001\n", "rank-001", "rank-00001", " rank-0001",
                 "rank-\uff10\uff10\uff10\uff11"):
        assert parse_rank_dirname(name) is None and rank_of_dirname(name) is None, name
    assert rank_dirname(7) == "rank-0007"
    with pytest.raises(ValueError):
        rank_dirname(10_000)
    with pytest.raises(ArchiveError):
        validate_place(f"{DEP}/{ARABIC_1234}")
    assert not TARGET_LABELS["rank"].fullmatch("\u0661\u0662\u0663\u0664")


def test_cli_and_transfer_api_take_the_same_deployment_prefixes(tmp_path: Path) -> None:
    """One ``--deployment`` rule (decision 2500): a unique 4-character prefix names the
    deployment for ``status`` (the CLI's narrowing) and for the transfer API's selection
    alike (the API wanted 8 characters, the CLI 4); a too-short one is refused by both."""
    from spoolctl.store.transfer.selection import resolve_deployments

    base = tmp_path / "base"
    with Store.open(base / DEP / rank_dirname(0), create=True):
        pass
    prefix = DEP[:6]  # unique here: one deployment
    assert resolve_deployments([prefix], [DEP]) == {DEP}
    code, out, _err = run("status", "--root", str(base), "--deployment", prefix, "--json")
    assert code == 0 and {s["deployment"] for s in json.loads(out)["stores"]} == {DEP}
    for refused in ("vll", "zzzz"):
        with pytest.raises(ConfigError, match="matches no deployment directory"):
            resolve_deployments([refused], [DEP])
        code, _out, err = run("status", "--root", str(base), "--deployment", refused)
        assert code == 2 and "matches no deployment directory" in err


def test_a_rank_that_cannot_be_read_means_the_ranks_do_not_agree(tmp_path: Path) -> None:
    """A ``rank-NNNN`` folder the scanner lists but no store can be opened in (here: no
    marker) is that rank's error, and the deployment's verdict is not "ranks agree": the
    rank cannot be shown to hold any chunk, so every chunk is a miss there."""
    base = tmp_path / "base"
    with Store.open(base / DEP / rank_dirname(0), create=True):
        pass
    (base / DEP / rank_dirname(1)).mkdir()
    (base / DEP / rank_dirname(1) / "stray").write_text("x")
    code, out, _err = run("status", "--root", str(base), "--json")
    dep = json.loads(out)["deployments"][DEP]
    assert code != 0 and not dep["agree"] and dep["unreadable_ranks"] == [1], dep
    _code, text, _err = run("status", "--root", str(base))
    assert "ranks agree" not in text and "rank 0001 could not be read" in text, text
