"""Issue 15.9 and 15.10: strict inputs everywhere, and a quarantine restore that tells the
truth.

* A hand-edited root marker with a ``created`` that is text or a list, a ``max_bytes`` of
  ``true`` (read as 1 byte it would make capacity maintenance evict everything) or text:
  one line naming the field, exit 2, nothing evicted.
* Public API calls with bad ``meta``, too many objects, payloads that are not bytes or
  arguments of the wrong type raise the store's own errors before the first write: no
  object, temp file or catalog row is left behind.
* Once orphan collection reclaimed a quarantined entry's healthy sibling objects,
  ``quarantine restore`` says in one line that the entry can no longer be restored and how
  to purge it (the command it names works).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from operator_cli import run, run_json

from spoolctl.store import ConfigError, InvalidIdError, SpoolError, Store

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)


@pytest.mark.parametrize(("field", "value", "says"), [
    ("created", "2026-01-01", "invalid created"),
    ("created", [1, 2], "invalid created"),
    ("max_bytes", True, "invalid max_bytes (true)"),
    ("max_bytes", "10GiB", "invalid max_bytes"),
    ("max_bytes", 1.5, "invalid max_bytes"),
    ("store_id", 42, "invalid store_id"),
])
def test_hand_edited_marker_fields_are_one_line(store_root: Path, field: str, value,
                                                says: str) -> None:
    with Store.open(store_root, create=True) as store:
        store.put(kind="pytorch", namespace="ns", key="k", objects={"kv": b"x" * 100})
    marker = store_root / ".spoolctl-root"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), field: value}))
    for args in (["status"], ["clean", "--capacity", "--dry-run", "--yes"], ["doctor"]):
        code, out, err = run(*args, "--root", str(store_root))
        if args[0] == "doctor":
            assert code == 1 and says in out, out
            continue
        assert code == 2, (args, out, err)
        assert err.count("\n") == 1 and says in err and "Traceback" not in err
    with pytest.raises(SpoolError, match=says.split(" (")[0]):
        Store.open(store_root)


def _nothing_written(root: Path) -> None:
    leftovers = [p for sub in ("objects", "manifests", "tmp") for p in (root / sub).rglob("*")
                 if p.is_file()]
    assert leftovers == []
    with Store.open(root) as store:
        assert store.totals().entries == 0 and store.entries(include_pending=True) == []


@pytest.mark.parametrize(("kwargs", "error", "says"), [
    ({"meta": {"tags": {"a", "b"}}}, ConfigError, "meta is not valid JSON data"),
    ({"meta": {"score": math.nan}}, ConfigError, "not finite"),
    ({"meta": {1: "x"}}, ConfigError, "not a string"),
    ({"meta": ["not", "a", "dict"]}, ConfigError, "meta must be a mapping"),
    ({"index": {"expire_time": "soon"}}, ConfigError, "expire_time"),
    ({"objects": {f"o{i}": b"x" for i in range(4097)}}, ConfigError, "at most 4096 objects"),
    ({"objects": {"kv": "text, not bytes"}}, ConfigError, "payload of object kv is a str"),
    ({"objects": {"kv": 12345}}, ConfigError, "payload of object kv is a int"),
    ({"objects": {"kv": None}}, ConfigError, "payload of object kv is a NoneType"),
    ({"objects": {"a": b"ok", "b": {"nested": b"x"}}}, ConfigError, "payload of object b"),
    ({"objects": [b"x"]}, ConfigError, "objects must be a mapping"),
    ({"objects": {"../x": b"x"}}, InvalidIdError, "invalid object name"),
    ({"supersedes": 7}, InvalidIdError, "supersedes must be an entry id"),
    ({"key": ""}, InvalidIdError, "invalid entry key"),
    ({"objects": {"kv": memoryview(b"abcdef")[::2]}}, ConfigError, "C-contiguous"),
])
def test_bad_put_arguments_fail_before_the_first_write(store_root: Path, kwargs: dict,
                                                       error: type, says: str) -> None:
    args = {"kind": "pytorch", "namespace": "ns", "key": "k",
            "objects": {"first": b"y" * 1000, "kv": b"x" * 1000}, **kwargs}
    with Store.open(store_root, create=True) as store:
        with pytest.raises(error) as info:
            store.put(**args)
        assert isinstance(info.value, SpoolError) and says in str(info.value)
        assert "\n" not in str(info.value)
    _nothing_written(store_root)


def test_restore_after_the_siblings_were_reclaimed_says_so(store_root: Path) -> None:
    good = os.urandom(2000)
    with Store.open(store_root, create=True) as store:
        m = store.put(kind="pytorch", namespace="ns", key="k",
                      objects={"a": good, "b": os.urandom(2000)})
        bad = store.layout.object_path(m.object("a").digest)
        bad.write_bytes(b"\0" * 2000)  # bit rot in one object
        with pytest.raises(SpoolError):
            store.read(m, "a")  # quarantined: manifest and the bad object move out
        sibling = store.layout.object_path(m.object("b").digest)
        assert sibling.exists()  # the healthy object stays, now an orphan
        assert store.collect_orphans(min_age=0).orphan_objects.objects == 1
        assert not sibling.exists()
    found = run_json("quarantine", "ls", "--root", str(store_root))["items"][0]
    item = found["item"]
    # the operator repairs the bad object in the evidence (from a backup, say) and restores
    (Path(found["path"]) / f"{m.object('a').digest}.obj").write_bytes(good)
    code, out, err = run("quarantine", "restore", item, "--root", str(store_root))
    assert code == 1 and out == "", (out, err)
    assert err.count("\n") == 1 and "can no longer be restored" in err, err
    assert f"spoolctl quarantine purge {item} --yes" in err
    assert str(sibling) not in err and "No such file" not in err  # no raw ENOENT text
    code, out, err = run("quarantine", "purge", item, "--yes", "--root", str(store_root))
    assert code == 0 and "purged 1 item," in out, err
    code, _, err = run("quarantine", "purge", item, "--yes", "--root", str(store_root))
    assert code == 1 and "no quarantine item" in err  # naming an item that is gone


def test_restore_of_a_healthy_entry_still_works(store_root: Path) -> None:
    with Store.open(store_root, create=True) as store:
        m = store.put(kind="pytorch", namespace="ns", key="k", objects={"a": b"x" * 500})
        store.quarantine_entry(m.entry_id, store_reason(), "operator test")
    item = run_json("quarantine", "ls", "--root", str(store_root))["items"][0]["item"]
    doc = run_json("quarantine", "restore", item, "--root", str(store_root))
    assert doc["restored"] and doc["entry_id"] == m.entry_id


def store_reason():
    from spoolctl.store import QuarantineReason

    return QuarantineReason.UNKNOWN
