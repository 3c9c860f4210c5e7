"""Issue 15 item 1 / 21, decision 1100 for ``export`` and ``import``: they accept the roots
every other operator command accepts (a store, the connector's base root, a deployment
directory, an empty base root before the first engine start), refuse the same ones, narrow
with the same ``--rank`` / ``--deployment``, and report per rank (human and JSON), with
one rank that cannot be read reported while the others are exported. The deployment
placement rule (decision 1602) is unchanged (``test_export_import.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from operator_cli import run, run_json

from spoolctl.store import Store

DEP_A = "vllm-v1-" + "a1" * 24
DEP_B = "vllm-v1-" + "b2" * 24


def _fill(rank_root: Path, rank: int, n: int = 3) -> None:
    with Store.open(rank_root, create=True) as store:
        for i in range(n):
            store.put(kind="vllm", namespace=f"vllm-v1-ns-r{rank}", key=f"{i:064x}",
                      objects={"kv": os.urandom(2048)}, meta={"chunk_index": i})


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """A base root: deployment A with ranks 0 and 1, deployment B with rank 0."""
    base = Path(os.path.realpath(tmp_path)) / "spool"
    for dep, ranks in ((DEP_A, (0, 1)), (DEP_B, (0,))):
        for rank in ranks:
            _fill(base / dep / f"rank-{rank:04d}", rank)
    return base


def _ranks(doc: dict) -> list[tuple[str | None, int | None]]:
    return sorted((s["deployment"], s["rank"]) for s in doc["stores"])


def test_export_and_import_take_the_roots_and_filters_of_every_command(base: Path,
                                                                        tmp_path: Path):
    archive = str(tmp_path / "all.tar")
    doc = run_json("export", "--root", str(base), "-o", archive)
    assert doc["kind"] == "base" and doc["exit"] == 0 and doc["entries"] == 9
    assert _ranks(doc) == [(DEP_A, 0), (DEP_A, 1), (DEP_B, 0)]
    assert all(s["exit"] == 0 and s["root"].startswith(str(base)) for s in doc["stores"])
    one_dep = run_json("export", "--root", str(base / DEP_A), "-o", str(tmp_path / "a.tar"))
    assert one_dep["kind"] == "deployment" and _ranks(one_dep) == [(DEP_A, 0), (DEP_A, 1)]
    # the same --deployment prefix status accepts (4+ characters, unique)
    prefix = DEP_B[:12]
    assert _ranks(run_json("status", "--root", str(base), "--deployment", prefix)) == \
        [(DEP_B, 0)]
    only_b = run_json("export", "--root", str(base), "--deployment", prefix,
                      "-o", str(tmp_path / "b.tar"))
    assert _ranks(only_b) == [(DEP_B, 0)] and only_b["entries"] == 3
    # --rank: that rank's shards as they are (no quorum across ranks)
    rank1 = run_json("export", "--root", str(base), "--rank", "1", "-o", str(tmp_path / "1.tar"))
    assert _ranks(rank1) == [(DEP_A, 1)] and rank1["entries"] == 3
    code, out, err = run("export", "--root", str(base), "--rank", "1",
                         "-o", str(tmp_path / "1h.tar"))
    assert code == 0 and "exported 3 entries" in out and "rank-0001" in out, (out, err)
    # import --rank: a host takes its own ranks of a whole archive
    fresh = tmp_path / "fresh"
    got = run_json("import", "--root", str(fresh), archive, "--rank", "0")
    assert got["imported"] == 6 and sorted(os.listdir(fresh)) == [DEP_A, DEP_B]
    assert os.listdir(fresh / DEP_A) == ["rank-0000"]
    mine = {(s["deployment"], s["rank"]): s for s in got["stores"]}
    assert mine[(DEP_A, 1)]["imported"] == 0 and mine[(DEP_A, 0)]["imported"] == 3
    rest = run_json("import", "--root", str(fresh), archive)  # the other ranks, later
    assert rest["imported"] == 3 and rest["present"] == 6
    assert run_json("status", "--root", str(fresh / DEP_A))["agree"]
    code, _out, err = run("import", "--root", str(tmp_path / "x"), archive, "--rank", "7")
    assert code == 2 and "no store for rank 7" in err and len(err.strip().splitlines()) == 1


def test_an_empty_base_root_is_nothing_to_do_like_for_every_command(tmp_path: Path):
    empty = Path(os.path.realpath(tmp_path)) / "spool"
    empty.mkdir()
    assert run("clean", "--yes", "--root", str(empty))[0] == 0
    archive = str(tmp_path / "empty.tar")
    doc = run_json("export", "--root", str(empty), "-o", archive)
    assert doc["kind"] == "empty" and doc["entries"] == 0 and doc["stores"] == []
    code, out, _err = run("export", "--root", str(empty), "-o", str(tmp_path / "e2.tar"))
    assert code == 0 and "nothing to export" in out
    got = run_json("import", "--root", str(tmp_path / "new"), archive)
    assert got["complete"] and got["imported"] == 0
    code, out, _err = run("import", "--root", str(tmp_path / "new2"), archive)
    assert code == 0 and "nothing to import" in out


def test_a_rank_that_cannot_be_read_does_not_stop_the_export(base: Path, tmp_path: Path):
    (base / DEP_A / "rank-0001" / ".spoolctl-root").write_text("{broken")
    archive = str(tmp_path / "part.tar")
    code, out, err = run("export", "--root", str(base), "-o", archive, "--json")
    assert code == 2, err
    import json

    doc = json.loads(out)
    by = {(s["deployment"], s["rank"]): s for s in doc["stores"]}
    assert "marker" in by[(DEP_A, 1)]["error"] and by[(DEP_A, 1)]["exit"] == 2
    assert by[(DEP_B, 0)]["entries"] == 3  # the other deployment is exported
    # deployment A's chunks are whole only with rank 1: none is taken
    assert by[(DEP_A, 0)]["entries"] == 0 and doc["left_out"]["incomplete_chunks"] == 3
    assert f"{DEP_A}/rank-0001" in err and len(err.strip().splitlines()) == 1
    got = run_json("import", "--root", str(tmp_path / "fresh"), archive)
    assert got["imported"] == 3 and (tmp_path / "fresh" / DEP_B / "rank-0000").is_dir()


def test_roots_and_filters_are_refused_like_for_every_command(base: Path, tmp_path: Path):
    junk = Path(os.path.realpath(tmp_path)) / "junk"  # a stray file and no deployment
    junk.mkdir()
    (junk / "notes.txt").write_text("not a deployment")
    for args in (["clean", "--yes"], ["export", "-o", str(tmp_path / "x.tar")],
                 ["import", str(tmp_path / "none.tar")]):
        code, _out, err = run(*args, "--root", str(junk))
        assert code == 2 and "not a spoolctl store, vLLM deployment directory or base root" \
            in err, (args, err)
    store = base / DEP_B / "rank-0000"
    for args in (["clean", "--yes"], ["export", "-o", str(tmp_path / "y.tar")]):
        code, _out, err = run(*args, "--root", str(store), "--rank", "0")
        assert code == 2 and "apply to a vLLM base root" in err, (args, err)
    code, _out, err = run("export", "--root", str(base), "--deployment", "zzzz",
                          "-o", str(tmp_path / "z.tar"))
    assert code == 2 and "matches no deployment directory" in err
    assert not (tmp_path / "z.tar").exists()
