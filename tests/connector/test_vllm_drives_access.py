"""A drive the connector's user may not use (issue 32 item 4, decision 2714's plan: "a
chmod'ed drive"), as an outside user meets it: the engine's user is not root (root ignores
mode bits), so each test runs its connector part as ``nobody`` through
``tests/unprivileged.py``, on drive directories that user owns. One drive left
``chmod 000`` among three: the others open and serve, it is pending with one warning naming
its path and the fix (not "remove the drive marker", which would cost its chunks), and
with its permissions back it opens."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
from operator_cli import script
from owned_stores import shared_dir
from testpaths import TESTS_DIR
from unprivileged import PRELOAD_ENV, unprivileged_uid

RUNNER = str(TESTS_DIR.joinpath("unprivileged.py"))
UID = unprivileged_uid()

def route_over(ids, up):
    """A stager's route over ``ids`` (``DriveSet.route``'s rule): (drive, home) or None."""
    from spoolctl.connector.drives import placement

    def route(key, avoid=()):
        drive = placement.route(key, ids, {d for d in ids if d not in avoid and up(d)})
        return (drive, placement.home(key, ids)) if drive is not None else None

    return route



def as_user(code: str, *, preload: str, timeout: float = 120) -> dict:
    """``code`` run as the unprivileged user with ``preload`` (modules) loaded before the
    drop; the JSON document it printed last."""
    proc = script(RUNNER, "py", textwrap.dedent(code), program=sys.executable, cwd="/tmp",
                  env={PRELOAD_ENV: preload}, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def bases():
    """Three drive base roots the unprivileged user owns (pytest's tmp_path is root-only)."""
    for top in shared_dir("spool-drives-"):
        made = [top / f"nvme{i}" / "spool" for i in range(3)]
        for base in made:
            base.mkdir(parents=True)
            for path in (base, base.parent):
                os.chown(path, UID, -1)
        yield made


# What the unprivileged side runs first: the connector's log lines kept, the three drives'
# stores opened by a worker (``DriveStores.open``, decision 2714 item 4).
_OPEN = """
    import json, logging, os, threading
    from spoolctl.connector.drives.opening import DriveStores
    from spoolctl.connector.drives.rankstores import OpenStores

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.lines = []
        def emit(self, record):
            self.lines.append(record.getMessage())

    keep = Keep()
    logging.getLogger("spoolctl.connector").addHandler(keep)
    bases = {bases!r}
    roots = [(b, os.path.join(b, "vllm-v1-x", "rank-0000")) for b in bases]
"""


def test_a_drive_its_user_may_not_read_is_pending_with_the_fix_and_opens_once_allowed(
        bases: list[Path]) -> None:
    """The worker's drives (``DriveStores``) with the second drive ``chmod 000``: the
    others open (the engine starts and serves them), the second is pending with one
    warning naming its base root and the fix; ``chmod 755`` → the retry opens it (its drive
    id written then) without a second warning."""
    bases[1].chmod(0)
    doc = as_user(_OPEN.format(bases=[str(b) for b in bases]) + """
    joined = threading.Event()
    d = DriveStores.open(roots, OpenStores(), create=True, deadline_s=1, probe_interval_s=0.05,
                         on_open=lambda slot: joined.set())
    states = [s.state for s in d.slots]
    warned = list(keep.lines)
    os.chmod(bases[1], 0o755)  # its owner gives the permissions back
    print(json.dumps({"states": states, "warned": warned, "joined": joined.wait(60),
                      "after": [s.state for s in d.slots], "ids": [s.drive_id for s in d.slots],
                      "lines": keep.lines}))
    d.close()
    """, preload="spoolctl.connector.drives.opening")
    assert doc["states"] == ["open", "pending", "open"]
    root = bases[1] / "vllm-v1-x" / "rank-0000"
    assert doc["warned"] == [
        f"spoolctl: rank store {root} not open ({bases[1]}: permission denied for uid {UID}; "
        "give that user read, write and search permission on it (chown or chmod)); serving "
        "without it (misses) and trying again every 0.05 s"]
    assert doc["joined"] and doc["after"] == ["open"] * 3 and len(set(doc["ids"])) == 3
    assert doc["lines"][1:] == [
        f"spoolctl: drive root {bases[1]} answers; its rank store is in use: {root}"]


# -- the worker itself, as the engine's user (vLLM's import and two connector starts) ------

_WORKER = _OPEN + """
    import sys
    sys.path.insert(0, {tests!r})
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_configs import vllm_configs
    from spoolctl.connector import SpoolConnector
    from spoolctl.connector.drives import placement as drives
    from spoolctl.connector.kv.kvio import DONE

    opened = threading.Event()
    keep.emit = lambda record: (keep.lines.append(record.getMessage()),
                                "answers; its rank store is in use" in record.getMessage()
                                and opened.set())
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    vcfg, kcfg = vllm_configs(bases[0], [spec], num_blocks=8, spoolctl_scrub_rate="0",
                              spoolctl_probe_interval="0.05")
    extra = vcfg.kv_transfer_config.kv_connector_extra_config
    del extra["spoolctl_root"]
    extra["spoolctl_roots"] = bases

    def start():
        w = SpoolConnector(vcfg, KVConnectorRole.WORKER, kcfg)
        w.register_kv_caches({{"layer.0": torch.zeros(8, 2, 32, 64)}})
        return w

    def fill(buf):
        view = buf.numpy()
        view[:] = 7
        return {{"kv": memoryview(view)}}, DONE

    def store(w, seed):
        keys = [f"{{seed}}{{i:063x}}"[-64:] for i in range(12)]
        for i, key in enumerate(keys):
            w.worker.stager.stage(key, i, fill, request=seed)
        assert w.worker.flush(60)
        return keys

    def where(w, keys):  # the base root of the drive each key is read from
        h = w.worker.holdings
        by_id = {{drives.read_drive_id(b): b for b in bases if os.access(b, os.R_OK)}}
        return [by_id.get(h.locate(k)) for k in keys]
"""


def _worker_as_user(bases: list[Path], steps: str) -> dict:
    code = _WORKER.format(bases=[str(b) for b in bases], tests=str(TESTS_DIR))
    return as_user(code + steps, timeout=300, preload=",".join([
        "torch", "vllm", "vllm.distributed.kv_transfer.kv_connector.v1.base",
        "vllm.v1.kv_cache_interface", "spoolctl.connector.connector",
        "spoolctl.connector.worker_side.worker", "spoolctl.connector.drives.opening"]))


@pytest.mark.extended  # vLLM's import in a process of its own, two connector starts (~20 s)
def test_a_worker_whose_user_may_not_read_one_drive_starts_serves_the_others_and_uses_it_next_start(
        bases: list[Path]) -> None:
    """The worker over three drives, the second ``chmod 000``: it starts, its rank store on
    the other two drives serves (chunks stored and found there), one warning names the
    drive and the fix; permissions back, the next start uses all three: what was stored is
    still found, and the second drive takes its share of new chunks."""
    bases[1].chmod(0)
    doc = _worker_as_user(bases, """
    w = start()
    first = {"roots": len(w.store_roots), "lines": list(keep.lines)}
    old = store(w, "a")
    first["where"] = where(w, old)
    w.shutdown()
    os.chmod(bases[1], 0o755)
    w = start()
    new = store(w, "b")
    print(json.dumps({"first": first, "roots": len(w.store_roots), "old": where(w, old),
                      "new": where(w, new)}))
    w.shutdown()
    """)
    first = doc["first"]
    assert first["roots"] == 2 and None not in first["where"]
    assert set(first["where"]) == {str(bases[0]), str(bases[2])}
    (said,) = [line for line in first["lines"] if str(bases[1]) in line]  # one warning
    assert f"({bases[1]}: permission denied for uid {UID}; give that user read, write and " \
        "search permission on it (chown or chmod))" in said
    assert doc["roots"] == 3 and doc["old"] == first["where"]
    assert str(bases[1]) in doc["new"] and None not in doc["new"]


@pytest.mark.extended  # vLLM's import in a process of its own (~15 s)
def test_a_drive_given_its_permissions_back_while_serving_takes_its_share_at_once(
        bases: list[Path]) -> None:
    bases[1].chmod(0)
    doc = _worker_as_user(bases, """
    w = start()
    os.chmod(bases[1], 0o755)
    assert opened.wait(60)
    import time
    deadline = time.monotonic() + 60
    while len(w.worker.holdings.drive_ids()) < 3:  # the engine thread's next hook joins it
        assert time.monotonic() < deadline, "the drive never joined"
        w.worker.take_stats()
        time.sleep(0.05)
    print(json.dumps({"new": where(w, store(w, "c"))}))
    w.shutdown()
    """)
    assert str(bases[1]) in doc["new"]


# -- drive roots an operator got wrong (the outside pass) ------------------------------------


@pytest.mark.parametrize("mistake", ["symlink", "file", "read-only"])
def test_a_drive_root_an_operator_got_wrong_is_one_line_naming_the_fix(
        tmp_path: Path, mistake: str, request: pytest.FixtureRequest, caplog) -> None:
    """The drive listed twice through a symlink, a file listed as a drive, a drive on a
    read-only mount: the other drives open; a mistake no retry can mend is ``refused``
    with one error line naming it and the fix (it was pending, "trying again" forever, or
    "does not exist (not mounted?)" for a file, plus a second line with a Python repr); a
    read-only filesystem, which a remount mends, is pending with a warning saying so (not
    "permission denied ... chmod")."""
    import subprocess

    from spoolctl.connector.drives.opening import OPEN, PENDING, REFUSED, DriveStores
    from spoolctl.connector.drives.rankstores import OpenStores

    here = Path(os.path.realpath(tmp_path))
    good = here / "nvme0" / "spool"
    good.mkdir(parents=True)
    if mistake == "symlink":
        wrong = here / "also-nvme0"
        wrong.symlink_to(good)
    elif mistake == "file":
        wrong = here / "nvme1"
        wrong.write_text("not a drive")
    else:
        wrong = request.getfixturevalue("mount_tmpfs")("1m")
        subprocess.run(["mount", "-o", "remount,ro", str(wrong)], check=True)
    roots = [(str(b), str(b / "vllm-v1-x" / "rank-0000")) for b in (good, wrong)]
    caplog.set_level("WARNING", logger="spoolctl.connector")
    d = DriveStores.open(roots, OpenStores(), create=True, deadline_s=1, probe_interval_s=0.05)
    try:
        said = [(r.levelname, r.getMessage()) for r in caplog.records]
        states = [s.state for s in d.slots]
    finally:
        d.close()
    if mistake == "symlink":
        assert states == [OPEN, REFUSED]
        (line,) = said
        assert line[0] == "ERROR" and line[1].startswith(
            f"spoolctl: drive root {wrong} not used until the engine restarts: store root "
            "path goes through a symlink") and f"use the real path ({good}" in line[1]
    elif mistake == "file":
        assert states == [OPEN, REFUSED]
        assert said == [("ERROR", f"spoolctl: drive root not used: {wrong} is not a directory; "
                                  "list a drive's directory (its mount point) in spoolctl_roots")]
    else:
        assert states == [OPEN, PENDING]
        (line,) = said
        assert line[0] == "WARNING" and f"({wrong} is on a read-only filesystem; remount it " \
            "read-write, or remove it from spoolctl_roots)" in line[1]


def test_a_drive_on_a_filesystem_without_hard_links_is_refused_with_the_fix(
        tmp_path: Path, caplog) -> None:
    """A drive root on a filesystem without hard links (a real FUSE mount refusing them, as
    vfat and many FUSE and SMB mounts do): its drive marker can never be written. The other
    drive opens; this one is refused with one error line naming it and the fix, not retried
    with an errno forever (decision 2792's finding), and no temporary marker is left."""
    from fusemount import Mounts

    from spoolctl.connector.drives.opening import OPEN, REFUSED, DriveStores
    from spoolctl.connector.drives.rankstores import OpenStores

    here = Path(os.path.realpath(tmp_path))
    good, odd = here / "nvme0" / "spool", here / "nvme1" / "spool"
    good.mkdir(parents=True)
    odd.mkdir(parents=True)
    with Mounts(here / "fuse") as mounts:
        mounts.over(odd).refuse_links()
        roots = [(str(b), str(b / "vllm-v1-x" / "rank-0000")) for b in (good, odd)]
        caplog.set_level("WARNING", logger="spoolctl.connector")
        d = DriveStores.open(roots, OpenStores(), create=True, deadline_s=1,
                             probe_interval_s=0.05)
        try:
            said = [(r.levelname, r.getMessage()) for r in caplog.records]
            states = [s.state for s in d.slots]
        finally:
            d.close()
        assert states == [OPEN, REFUSED]
        (line,) = said
        assert line[0] == "ERROR" and f"{odd} is on a filesystem without hard links" in \
            line[1] and "put this drive root on a local filesystem such as ext4 or xfs" in line[1]
        assert os.listdir(odd) == []  # no marker, no temporary marker


def test_a_drive_that_fills_up_passes_its_chunks_to_a_drive_with_room(
        tmp_path: Path, mount_tmpfs) -> None:
    """Two drives, the second a small filesystem (its own size below any ``max_size``):
    once a commit there fails for want of space, the chunks homed on it are written to
    the other drive (counted as failovers) instead of being skipped one by one for as long
    as it stays full; only the chunks of the commits that met the full disk are lost."""
    pytest.importorskip("torch")
    from spoolctl import metrics as m
    from spoolctl.connector.drives import placement as drives
    from spoolctl.connector.kv.kvio import DONE
    from spoolctl.connector.stats import ConnectorCounters
    from spoolctl.connector.worker_side.capture import (
        ChunkStager,
        rank_commit,
        rank_commit_many,
    )
    from spoolctl.connector.worker_side.holdings import RankHoldings
    from spoolctl.store import Store

    chunk = 32 << 10
    bases = [Path(os.path.realpath(tmp_path)) / "nvme0", mount_tmpfs("640k")]
    bases[0].mkdir()
    ids = [drives.drive_id(b) for b in bases]
    stores = {d: Store.open(b / "vllm-v1-x" / "rank-0000", create=True)
              for d, b in zip(ids, bases, strict=True)}
    counters = ConnectorCounters()
    holdings = RankHoldings.for_drives(stores, lambda d: True, kind="vllm", namespace="ns",
                                       rank=0, epoch=1)
    commits = {d: (rank_commit(s, "ns", holdings, drive=d),
                   rank_commit_many(s, "ns", holdings, drive=d), None)
               for d, s in stores.items()}
    stager = ChunkStager.for_drives(commits, route_over(ids, lambda d: True),
                                    {d: str(b) for d, b in zip(ids, bases, strict=True)},
                                    chunk_bytes=chunk, staging_bytes=4 * chunk, meta={},
                                    counters=counters)

    def fill(buf):
        view = buf.numpy()
        view[:] = 7
        return {"kv": memoryview(view)}, DONE

    keys = [f"{i:064x}" for i in range(60)]
    try:
        for i, key in enumerate(keys):
            stager.stage(key, i, fill)  # one request each: no gap ends a prompt early
            assert stager.flush(60)
        homed = [k for k in keys if drives.home(k, ids) == ids[1]]
        lost = counters.total(m.STORES_SKIPPED, reason="io_error")
        stored = {d: s.live_keys("vllm", "ns") for d, s in stores.items()}
        assert 0 < lost < 3  # the commits that met the full disk (one chunk each)
        assert len(stored[ids[0]] | stored[ids[1]]) == len(keys) - lost
        assert counters.total(m.DRIVE_FAILOVER_STORES, drive=str(bases[1])) == \
            len(homed) - len(stored[ids[1]]) - lost > 0
    finally:
        assert stager.close(60)
        for store in stores.values():
            store.close()


def test_a_drive_unmounted_while_serving_is_taken_out_and_its_chunks_fail_over(
        tmp_path: Path, mount_tmpfs) -> None:
    """The worker over two drives, the second a mount; it is unmounted while the engine
    serves (``umount -l``: the path now leads to the empty mount point). Three failed
    commits take the drive out and its chunks are written to the other drive (decision
    2790; before it every chunk homed there was skipped ``io_error``, "opening a lock file
    failed", for good)."""
    import subprocess

    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_configs import vllm_configs

    from spoolctl import metrics as m
    from spoolctl.connector import SpoolConnector
    from spoolctl.connector.kv.kvio import DONE

    bases = [Path(os.path.realpath(tmp_path)) / "nvme0", mount_tmpfs("16m")]
    bases[0].mkdir()
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    vcfg, kcfg = vllm_configs(str(bases[0]), [spec], num_blocks=8, spoolctl_scrub_rate="0",
                              spoolctl_probe_interval="3600")
    extra = vcfg.kv_transfer_config.kv_connector_extra_config
    del extra["spoolctl_root"]
    extra["spoolctl_roots"] = [str(b) for b in bases]
    worker = SpoolConnector(vcfg, KVConnectorRole.WORKER, kcfg)

    def fill(buf):
        view = buf.numpy()
        view[:] = 7
        return {"kv": memoryview(view)}, DONE

    try:
        worker.register_kv_caches({"layer.0": torch.zeros(8, 2, 32, 64)})
        ws = worker.worker
        subprocess.run(["umount", "-l", str(bases[1])], check=True)
        for i in range(24):
            ws.stager.stage(f"{i:064x}", i, fill)
            assert ws.flush(60)
        assert ws.counters.total(m.STORES_SKIPPED, reason="io_error") <= 3
        assert ws.counters.total(m.DRIVE_FAILOVER_STORES, drive=str(bases[1])) > 0
    finally:
        worker.shutdown()
