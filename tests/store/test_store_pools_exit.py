"""Issue 28 item 8: the store's three helper-thread pools (fsyncs, the hash of a large
verified read, the unlinks of a clean) are one helper (``pools.LazyPool``) and behave
alike at interpreter exit: ``concurrent.futures`` shuts its pools down before ``atexit``
handlers run, so work submitted from an ``atexit`` drain runs on the calling thread instead
of failing. Before, the unlink pool raised "cannot schedule new futures after interpreter
shutdown" there (the other two had their own fallback).

Only a real interpreter exit shows this: each case is a child process."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)

CHILD = textwrap.dedent("""
    import atexit, json, os, sys
    from pathlib import Path
    from spoolctl.store import Store
    from spoolctl.store.disk import dirfd, fsio

    root, mode = Path(sys.argv[1]), sys.argv[2]
    BIG = os.urandom(5 << 20)  # over INLINE_HASH_MAX: the verified read pipelines its hash

    def work(tag):
        with Store.open(root, create=True) as s:
            m = s.put(kind="pytorch", namespace="ns", key=tag, objects={"kv": BIG})  # fsyncs
            read_ok = bytes(s.read(m, "kv")) == BIG  # the hash pool
        junk = root.parent / f"junk-{tag}"
        junk.mkdir()
        paths = [junk / f"f{i}" for i in range(2 * fsio.UNLINK_WORKERS + 8)]  # on the pool
        for p in paths:
            p.write_bytes(b"x")
        with dirfd.DirFds() as dirs:
            outcomes = list(fsio.unlink_many(paths, dirs))
        return {"read_ok": read_ok, "unlinked": outcomes.count(True), "of": len(paths),
                "left": len(os.listdir(junk))}

    atexit.register(lambda: print(json.dumps(work("exit"))))
    if mode == "used_before_exit":
        work("main")
""")


@pytest.mark.parametrize("mode", ["used_before_exit", "first_used_at_exit"])
def test_every_pool_works_from_an_atexit_handler(tmp_path: Path, mode: str) -> None:
    root = Path(os.path.realpath(tmp_path)) / "store"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(root), mode], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == \
        {"read_ok": True, "unlinked": 40, "of": 40, "left": 0}, proc.stderr


def test_a_forked_child_gets_its_own_pools(tmp_path: Path) -> None:
    """``status`` and ``metrics`` read each store in a forked child (decision 2701). The
    child inherited the parent's executor, which has no threads there yet counts its idle
    workers: the first fsync the child handed it waited forever. Seen as ``status`` run in a
    process that had committed before (the in-process CLI, a program calling ``main``
    twice) on a store it marks v2 at open (decision 2831): "the store's disk did not answer
    within 10 s", and a child left waiting for good."""
    from spoolctl.store.disk import fsio

    fsio.write_tmp(tmp_path, [b"parent"])  # the parent's flush pool now has a worker
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one fsync through the pool, answer, exit
        try:
            fsio.write_tmp(tmp_path, [b"child"])
            os.write(write_end, b"ok")
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 30)
        answer = os.read(read_end, 2) if ready else b""
    finally:
        os.close(read_end)
        if not answer:
            os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert answer == b"ok", "the child's fsync never ran on the inherited pool"
