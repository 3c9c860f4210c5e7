"""Issue 30.12: the safe vLLM setting is the one users get (no engine started here).

* ``spoolctl config vllm`` says, beside the JSON, to pass ``--shutdown-timeout`` (stdout
  stays the JSON alone, for ``--kv-transfer-config "$(spoolctl config vllm)"``);
* the connector warns once at start-up when vLLM will kill the engine without a drain;
* once a chunk of a request is not stored, its later chunks are not stored either: no
  restore can reach them (the lookup is the longest run from the first chunk), so what is
  on disk after a kill is what a restart can use.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from types import SimpleNamespace

from operator_cli import run

from spoolctl import metrics as m
from spoolctl.connector.kv.kvio import DONE
from spoolctl.connector.stats import ConnectorCounters
from spoolctl.connector.worker_side import exitdrain
from spoolctl.connector.worker_side.capture import ChunkStager
from spoolctl.store import Store


def test_config_vllm_names_the_shutdown_timeout_beside_the_json(tmp_path: Path) -> None:
    code, out, err = run("config", "vllm", "--root", str(tmp_path / "spool"), "--max-size", "1GiB")
    assert code == 0, err
    assert json.loads(out)["kv_connector"] == "SpoolConnector"  # stdout: the JSON alone
    assert "--shutdown-timeout 30" in err


def test_the_connector_warns_once_when_vllm_will_not_drain(caplog) -> None:
    exitdrain._warned_no_drain = False
    with caplog.at_level(logging.WARNING, logger="spoolctl.connector"):
        assert not exitdrain.warn_without_drain(SimpleNamespace(shutdown_timeout=30))
        assert not exitdrain.warn_without_drain(SimpleNamespace())  # another vLLM: not judged
        assert exitdrain.warn_without_drain(SimpleNamespace(shutdown_timeout=0))
        assert exitdrain.warn_without_drain(SimpleNamespace(shutdown_timeout=0))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--shutdown-timeout 30" in warnings[0]


def test_the_connector_calls_the_check_at_start_up() -> None:
    """The scheduler side runs the check (one per engine) in the connector's constructor
    (read from the source: importing the connector imports vLLM, ~15 s)."""
    import ast

    source = (Path(exitdrain.__file__).parent.parent / "connector.py").read_text()
    init = next(n for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    calls = {n.func.id for n in ast.walk(init)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "warn_without_drain" in calls


def test_chunks_past_a_gap_are_not_stored(tmp_path: Path) -> None:
    """A staging budget of 2 chunks while the disk is slow: chunk 2 of request A is skipped
    (budget); once the writer catches up, A's chunks 3-5 are skipped too (``after_gap``),
    while request B, which lost nothing, stores all of its chunks. Before: A's 3-5 were
    committed past the hole, bytes no restore could reach."""
    gate = threading.Event()
    with Store.open(tmp_path / "s", create=True) as store:

        def put(key, objects, meta) -> None:
            gate.wait(60)
            store.put(kind="vllm", namespace="ns", key=key, objects=objects, meta=meta)

        counters = ConnectorCounters()
        stager = ChunkStager(put, chunk_bytes=4096, staging_bytes=2 * 4096, meta={},
                             counters=counters)

        def fill(buf):
            buf.fill_(7)
            return {"kv": memoryview(buf.numpy())}, DONE

        for i in range(3):  # 0 and 1 fill the budget; 2 is skipped
            stager.stage(f"a{i}", i, fill, request="A")
        gate.set()
        assert stager.flush(60)
        for i in range(3, 6):
            stager.stage(f"a{i}", i, fill, request="A")
        for i in range(2):
            stager.stage(f"b{i}", i, fill, request="B")
        assert stager.close(60)
        keys = sorted(r.key for r in store.entries())
    assert keys == ["a0", "a1", "b0", "b1"]
    assert counters.total(m.STORES_SKIPPED, reason="budget") == 1
    assert counters.total(m.STORES_SKIPPED, reason="after_gap") == 3
