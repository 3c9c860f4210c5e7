"""Metric names (one place, closed labels) and the store gauge rendering."""

from __future__ import annotations

import subprocess
import sys

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from spoolctl import metrics
from spoolctl.store import Store
from spoolctl.store.maintain.scrub import Scrubber

pytestmark = pytest.mark.base  # runs on a base install too (scripts/run.sh test-base)


def _parse(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_names_are_unique_prefixed_and_use_the_closed_vocabulary() -> None:
    names = [m.name for m in metrics.ALL_METRICS]
    assert len(names) == len(set(names))
    assert all(n.startswith("spoolctl_") for n in names)
    for spec in metrics.ALL_METRICS:
        assert set(spec.labels) <= set(metrics.LABEL_VALUES) | set(metrics.PATTERN_LABELS)
    connector = {m.name for m in metrics.CONNECTOR_METRICS}
    for needed in ("spoolctl_lookups_total", "spoolctl_hit_tokens_total",
                   "spoolctl_restore_bytes_total", "spoolctl_restore_seconds",
                   "spoolctl_store_write_bytes_total", "spoolctl_stores_skipped_total",
                   "spoolctl_load_errors_total", "spoolctl_quarantine_events_total"):
        assert needed in connector
    assert metrics.LOOKUPS.labels == ("result", "reason")
    assert {"hit", "miss", "bypass", "error"} == metrics.LABEL_VALUES["result"]
    assert {"budget", "capacity", "io_error", "busy"} <= metrics.LABEL_VALUES["reason"]


def test_labels_outside_the_vocabulary_are_rejected() -> None:
    ok = metrics.check_labels(metrics.LOOKUPS, {"result": "hit", "reason": "none"})
    assert ok == {"result": "hit", "reason": "none"}
    with pytest.raises(ValueError):
        metrics.check_labels(metrics.LOOKUPS, {"result": "hit", "reason": "a" * 64})  # an id
    with pytest.raises(ValueError):
        metrics.check_labels(metrics.LOOKUPS, {"result": "hit"})
    with pytest.raises(ValueError):
        metrics.MetricSpec("other_total", "counter", "no prefix")
    with pytest.raises(ValueError):
        metrics.MetricSpec("spoolctl_x", "counter", "free label", ("prompt",))


def test_store_gauges_render_real_state(store: Store) -> None:
    ids = [store.put(kind="pytorch", namespace="m", key=f"k{i}",
                     objects={"kv": bytes([i]) * 1000}).entry_id for i in range(4)]
    store.release(ids[0])
    path = store.layout.object_path(store.manifest(ids[1]).objects[0].digest)
    path.write_bytes(b"\xee" * 1000)  # same size, wrong bytes
    Scrubber(store).run(until_complete=True)
    text = metrics.render_store_metrics(store)
    values = _parse(text)
    assert values[("spoolctl_store_entries", ())] == 3
    assert values[("spoolctl_store_released_entries", ())] == 1
    assert values[("spoolctl_store_quarantined_items", (("reason", "payload_digest"),))] == 1
    assert values[("spoolctl_store_quarantined_items", (("reason", "manifest_io"),))] == 0
    assert 1000 < values[("spoolctl_store_quarantined_bytes", ())] < 4000  # object + manifest
    assert values[("spoolctl_store_kind_entries", (("kind", "pytorch"),))] == 3
    assert values[("spoolctl_scrub_last_checked_entries", ())] == 3
    assert values[("spoolctl_scrub_last_quarantined_entries", ())] == 1
    assert values[("spoolctl_scrub_last_completed_timestamp_seconds", ())] > 0
    for entry_id in ids:  # no entry ids (or anything else free-form) in the output
        assert entry_id not in text and entry_id[:12] not in text
    # A fresh registry per call: rendering twice works and the global registry stays clean.
    def steady(parsed: dict) -> dict:  # the filesystem's free room moves with other writers
        return {k: v for k, v in parsed.items() if not k[0].startswith("spoolctl_fs_")}

    assert steady(_parse(metrics.render_store_metrics(store))) == steady(values)
    assert REGISTRY.get_sample_value("spoolctl_store_entries") is None


def test_store_package_and_cli_import_no_framework() -> None:
    code = ("import sys, spoolctl.metrics, spoolctl.store.maintain.scrub, "
            "spoolctl.store.maintain.maintainer, "
            "spoolctl.store.maintain.doctor, spoolctl.cli.app; "
            "print([m for m in ('torch', 'vllm', 'mlx', 'google.genai', 'transformers') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_gauge_samples_cross_the_bounded_readers_pipe_as_json(store: Store) -> None:
    """``status``/``metrics`` read a store in a forked child that answers in JSON
    (decision 2712): the samples come back the same, by metric name; a name that is not a
    store gauge is refused, never turned into something else."""
    import json

    samples = metrics.with_target(metrics.collect_store_gauges(store), "vllm-v1-" + "a1" * 24,
                                  3)
    back = metrics.samples_from_json(json.loads(json.dumps(metrics.samples_json(samples))))
    assert back == samples
    with pytest.raises(ValueError, match="is not a store gauge"):
        metrics.samples_from_json([["spoolctl_lookups_total", 1, [], []]])
