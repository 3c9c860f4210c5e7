"""Unit tests of the deployment-scale connector logic: rank roots, quorum, rank comparison,
multimodal identity in the chain, and ``spoolctl status`` on a deployment directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_configs import vllm_configs

from spoolctl.connector.deployment.settings import parse_settings
from spoolctl.connector.deployment.topology import (
    RankPlace,
    all_ranks,
    compare_ranks,
    quorum,
    rank_of_dirname,
)
from spoolctl.connector.planning.chain import MMSpan, chain_root, chunk_keys
from spoolctl.errors import ConfigError
from spoolctl.store import Store, entry_id_for

SPOOLCTL = str(Path(sys.executable).parent / "spoolctl")
ENV = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
ENV.pop("SPOOLCTL_ROOT", None)


def test_rank_roots_follow_the_parallel_config():
    s = parse_settings({"spoolctl_root": "/base"}, block_size=32, env={})
    places = all_ranks(tp_size=2, pp_size=2)
    roots = [s.root_for(digest="vllm-v1-d", place=p) for p in places]
    assert roots == [f"/base/vllm-v1-d/rank-{r:04d}" for r in range(4)]
    # PP-major global rank: stage 1, TP rank 0 is rank 2.
    assert RankPlace(tp_rank=0, pp_rank=1, tp_size=2, pp_size=2).rank == 2
    assert [rank_of_dirname(os.path.basename(r)) for r in roots] == [0, 1, 2, 3]
    assert rank_of_dirname("rank-1") is None and rank_of_dirname("store") is None
    with pytest.raises(ValueError):
        RankPlace(tp_rank=2, pp_rank=0, tp_size=2, pp_size=1)
    with pytest.raises(ValueError):
        s.root_for(digest="../escape", place=places[0])
    with pytest.raises(ConfigError, match="placeholders"):
        parse_settings({"spoolctl_root": "/base/{rank}"}, block_size=32, env={})


def test_quorum_needs_every_rank():
    assert quorum([[True, True, False], [True, False, True]], 3) == [True, False, False]
    assert quorum([[True, True]], 2) == [True, True]
    assert quorum([], 2) == [False, False]  # no rank answered: nothing is present
    assert quorum([[True, True], [True]], 2) == [False, False]  # malformed answer: fail closed


def test_compare_ranks_flags_partial_and_missing_ranks():
    same = compare_ranks({0: {"a", "b"}, 1: {"a", "b"}})
    assert same.agree and same.complete_keys == 2
    partial = compare_ranks({0: {"a", "b"}, 1: {"a"}})
    assert not partial.agree and partial.partial == {0: 0, 1: 1} and partial.complete_keys == 1
    gap = compare_ranks({0: {"a"}, 2: {"a"}})
    assert not gap.agree and gap.missing_ranks == (1,) and gap.complete_keys == 0


def test_media_identity_is_part_of_the_chain():
    root = chain_root("vllm-v1-ns", None)
    tokens = list(range(10, 10 + 128))
    img_a = MMSpan("hash-of-image-a", offset=70, length=20)
    img_b = MMSpan("hash-of-image-b", offset=70, length=20)
    text = chunk_keys(root, tokens, 64)
    with_a = chunk_keys(root, tokens, 64, [img_a])
    with_b = chunk_keys(root, tokens, 64, [img_b])
    # The chunk before the image is shared; the chunk holding the image differs per image.
    assert text[0] == with_a[0] == with_b[0]
    assert len({text[1], with_a[1], with_b[1]}) == 3
    # Same image at another placeholder offset/length: another entry.
    moved = chunk_keys(root, tokens, 64, [MMSpan("hash-of-image-a", offset=71, length=20)])
    assert moved[1] != with_a[1]
    assert chunk_keys(root, tokens, 64, [MMSpan("hash-of-image-a", 70, 19)])[1] != with_a[1]


def _put_chunks(root: Path, rank: int, keys: list[str]) -> None:
    with Store.open(str(root), create=True) as store:
        for key in keys:
            store.put(kind="vllm", namespace=f"vllm-v1-ns-r{rank}", key=key,
                      objects={"kv": os.urandom(256)}, meta={"chunk_index": 0})


def test_status_summarises_ranks_and_flags_disagreement(tmp_path: Path):
    dep = Path(os.path.realpath(tmp_path)) / "vllm-v1-digest"
    keys = [f"{i:064x}" for i in range(3)]
    _put_chunks(dep / "rank-0000", 0, keys)
    _put_chunks(dep / "rank-0001", 1, keys)
    ok = subprocess.run([SPOOLCTL, "status", "--root", str(dep), "--json", "--check"],
                        capture_output=True, text=True, env=ENV, timeout=120)
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["agree"] and doc["complete_chunks"] == 3
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert all(r["chunks"] == 3 and r["missing_chunks"] == 0 for r in doc["ranks"])

    # Rank 1 loses one entry (eviction, quarantine...): flagged, --check exits 1.
    with Store.open(str(dep / "rank-0001")) as store:
        store.release(entry_id_for("vllm", "vllm-v1-ns-r1", keys[2]))
    bad = subprocess.run([SPOOLCTL, "status", "--root", str(dep), "--json", "--check"],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert bad.returncode == 1, bad.stderr
    doc = json.loads(bad.stdout)
    assert not doc["agree"] and doc["complete_chunks"] == 2
    assert {r["rank"]: r["missing_chunks"] for r in doc["ranks"]} == {0: 0, 1: 1}

    # A rank directory missing altogether (its disk lost): flagged in the table.
    _put_chunks(dep / "rank-0003", 3, keys)
    table = subprocess.run([SPOOLCTL, "status", "--root", str(dep)],
                           capture_output=True, text=True, env=ENV, timeout=120)
    assert table.returncode == 0, table.stderr
    assert "ranks disagree" in table.stdout and "no store for rank 0002" in table.stdout


def _vllm_request(req_id: str, tokens: list[int], features: list) -> object:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, tokens, SamplingParams(max_tokens=1), None, mm_features=features)


def _feature(identifier: str | None, offset: int, length: int, modality: str | None = "image"):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(data=None, modality=modality, identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def test_vllm_multimodal_features_key_the_chain_and_incomplete_identity_bypasses():
    pytest.importorskip("vllm")
    from spoolctl.connector.scheduler_side.lookup import Bypass, mm_spans

    tokens = list(range(3, 3 + 200))
    root = chain_root("vllm-v1-ns", None)

    def keys(features):
        spans = mm_spans(_vllm_request("r", tokens, features))
        return chunk_keys(root, tokens, 64, spans)

    img_a, img_b = keys([_feature("a" * 64, 80, 30)]), keys([_feature("b" * 64, 80, 30)])
    text = keys([])
    assert img_a[0] == img_b[0] == text[0]  # before the image: shared
    assert img_a[1] != img_b[1] and img_a[1] != text[1]  # a different image: a different entry
    assert img_a[2] != img_b[2]  # and so is everything after it (chained)
    assert keys([_feature("a" * 64, 80, 30, modality="audio")])[1] != img_a[1]
    assert keys([_feature("a" * 64, 81, 30)])[1] != img_a[1]
    assert keys([_feature("a" * 64, 80, 31)])[1] != img_a[1]
    assert keys([_feature("a" * 64, 80, 30)]) == img_a  # deterministic
    # Incomplete identity, or vLLM's per-process counter name for media it did not hash
    # (it repeats after a restart): bypass.
    for incomplete in (_feature("", 80, 30), _feature(None, 80, 30),
                       _feature("a" * 64, 80, 30, modality=""),
                       _feature("renderer0-mm-7-image-0", 80, 30)):
        with pytest.raises(Bypass):
            mm_spans(_vllm_request("r", tokens, [incomplete]))


def test_group_semantics_supported_and_fail_closed():
    from spoolctl.connector.planning.groups import (
        GroupInfo,
        check_groups,
        is_single,
        unsupported_error,
    )

    full = GroupInfo(0, "full_attention", ("l0", "l1"), 32)
    # A hybrid model's sliding layers promoted to full-attention pages (HMA off): supported,
    # single-object format.
    promoted = GroupInfo(0, "full_attention", ("l0", "l1"), 32, sliding_window=32)
    assert check_groups([full]) is None and check_groups([promoted]) is None
    assert is_single([full]) and is_single([promoted])
    # Sliding windows alone or next to full attention (HMA on): grouped format.
    slide = GroupInfo(0, "sliding_window", ("l0",), 32, sliding_window=32)
    full1 = GroupInfo(1, "full_attention", ("l1",), 32)
    assert check_groups([slide], 64) is None and not is_single([slide])
    assert check_groups([slide, full1], 64) is None and not is_single([slide, full1])
    # Genuinely unsupported kinds, flags and block sizes fail closed, naming the groups.
    hybrid = check_groups([full, GroupInfo(1, "mamba", ("m0",), 32)])
    assert hybrid.startswith("2 KV cache groups") and "mamba" in hybrid
    assert "chunked_local_attention" in check_groups(
        [GroupInfo(0, "chunked_local_attention", ("x",), 32, attention_chunk_size=64)])
    assert "sliding_window_mla" in check_groups(
        [GroupInfo(0, "sliding_window_mla", ("x",), 32, sliding_window=32)])
    assert "draft" in check_groups(
        [slide, GroupInfo(1, "full_attention", ("d",), 32, flag="a draft-model group")])
    assert "window" in check_groups([GroupInfo(0, "sliding_window", ("x",), 32)], 64)
    assert "LCM is 96" in check_groups(
        [slide, GroupInfo(1, "full_attention", ("l1",), 96)], 64)
    assert check_groups([]) == "vLLM reported no KV cache groups"
    assert "unknown" in check_groups([GroupInfo(0, "unknown", ("x",), 16)])
    err = unsupported_error(check_groups([GroupInfo(0, "mamba", ("m",), 16)]))
    assert isinstance(err, ConfigError) and "spoolctl_on_unsupported" in str(err)
    assert "\n" not in str(err)


def test_group_layouts_store_only_the_window_tail():
    from spoolctl.connector.planning.groups import GroupInfo, group_layouts

    groups = [GroupInfo(0, "sliding_window", ("s",), 16, sliding_window=32),
              GroupInfo(1, "full_attention", ("f",), 32),
              GroupInfo(2, "sliding_window", ("w",), 16, sliding_window=200,
                        extra_retained_tokens=3)]
    s, f, w = group_layouts(groups, 128)
    # cdiv(32 + 0, 16) = 2 of the chunk's 8 blocks; full: all 4; window > chunk: all 8.
    assert (s.blocks_per_chunk, s.stored_blocks, s.first_stored) == (8, 2, 6)
    assert (f.blocks_per_chunk, f.stored_blocks, f.window) == (4, 4, None)
    assert (w.stored_blocks, w.extra) == (8, 3)
    assert [g.name for g in (s, f, w)] == ["g0", "g1", "g2"]


def test_grouped_planner_restores_every_allocated_block_and_stores_at_the_boundary():
    from spoolctl.connector.planning.groups import GroupInfo, group_layouts
    from spoolctl.connector.planning.plan import GroupedPlanner

    # Group 0 sliding (window 32, bs 32 -> tail of 1 block per 2-block chunk), group 1 full.
    layouts = group_layouts([GroupInfo(0, "sliding_window", ("s",), 32, sliding_window=32),
                             GroupInfo(1, "full_attention", ("f",), 32)], 64)
    p = GroupedPlanner(chunk_tokens=64, groups=layouts)
    keys = ["k0", "k1", "k2"]
    # 3 chunks + 11 tokens, all present: hit 192 tokens.
    assert p.lookup("r", keys, [True] * 3, 203, 0) == 192
    # vLLM: sliding positions below floor((192 - 32 + 1) / 32) = 5 are null.
    sliding = [0, 0, 0, 0, 0, 11, 12]
    full = [21, 22, 23, 24, 25, 26, 27]
    p.allocated("r", (sliding, full), 192)
    (load,) = p.take_loads()
    assert load.ok and [c.index for c in load.chunks] == [0, 1, 2]
    assert [c.targets for c in load.chunks] == [
        (None, (21, 22)), (None, (23, 24)), ((11,), (25, 26))]
    assert p.take_loads() == []
    # After the load: first step computes the tail; nothing new crosses a boundary.
    assert p.scheduled("r", (sliding, full), replace=True, computed_before=192,
                       computed_after=203, first=True) == []

    # A cold request: chunk c is stored in the step that crosses its boundary.
    p.lookup("c", keys, [False] * 3, 203, 0)
    st = p.scheduled("c", ([1, 2, 3], [4, 5, 6]), replace=True, computed_before=0,
                     computed_after=96, first=True)
    assert [(s.index, s.blocks) for s in st] == [(0, ((2,), (4, 5)))]
    # vLLM nulled position 0 meanwhile (never told); appended ids arrive.
    st = p.scheduled("c", ([7, 8], [9, 10]), replace=False, computed_before=96,
                     computed_after=203, first=False)
    assert [(s.index, s.blocks) for s in st] == [(1, ((7,), (6, 9)))]
    # Chunk 2's blocks were missing in its crossing step (vLLM always allocates them): it is
    # never captured later, when its ids may already be stale.
    st = p.scheduled("c", ([9], [11, 12]), replace=False, computed_before=203,
                     computed_after=204, first=False)
    assert st == [] and p.requests["c"].next_store == 3
    # A local prefix hit (first step, computed before): stored only without null ids.
    p.lookup("h", keys, [False] * 3, 203, 128)
    st = p.scheduled("h", ([0, 0, 0, 31, 32, 33, 34], [41, 42, 43, 44, 45, 46, 47]),
                     replace=True, computed_before=128, computed_after=203, first=True)
    assert [(s.index, s.blocks) for s in st] == [(1, ((31,), (43, 44))),
                                                 (2, ((33,), (45, 46)))]
    # A table vLLM did not fully allocate: the request recomputes (ok=False).
    p.lookup("x", keys, [True] * 3, 203, 0)
    p.allocated("x", ([0, 0, 0, 0, 0, 11], [21, 22]), 192)
    assert [ld.ok for ld in p.take_loads()] == [False]
    # After a failed restore: a lookup without restore still stores the absent chunks.
    assert p.lookup("f", keys, [True, True, False], 203, 0, restore=False) == 0
    st = p.scheduled("f", ([1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]), replace=True,
                     computed_before=0, computed_after=203, first=True)
    assert [s.index for s in st] == [2]
    p.finished("r")
    assert "r" not in p.requests


def test_on_unsupported_setting_is_validated():
    assert parse_settings({"spoolctl_root": "/b"}, block_size=32, env={}).on_unsupported == \
        "error"
    s = parse_settings({"spoolctl_root": "/b", "spoolctl_on_unsupported": "disable"},
                       block_size=32, env={})
    assert s.on_unsupported == "disable"
    with pytest.raises(ConfigError, match="spoolctl_on_unsupported"):
        parse_settings({"spoolctl_root": "/b", "spoolctl_on_unsupported": "maybe"},
                       block_size=32, env={})


def test_vllm_classifies_the_spec_kinds_the_connector_relies_on():
    pytest.importorskip("vllm")
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from spoolctl.connector.vllm_api.introspect import group_infos

    class Group:
        def __init__(self, names, spec):
            self.layer_names, self.kv_cache_spec = names, spec

    class Config:
        kv_cache_groups = [
            Group(["a"], FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32,
                                           dtype=torch.float32, sliding_window=16)),
            Group(["b"], SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32,
                                           dtype=torch.float32, sliding_window=16))]

    infos = group_infos(Config(), 32)
    assert [(g.kind, g.sliding_window) for g in infos] == [("full_attention", 16),
                                                           ("sliding_window", 16)]


def _scheduler_connector(groups: list, tmp_path: Path, **extra: str):
    """A scheduler-role SpoolConnector over hand-built vLLM configs and real vLLM specs."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from spoolctl.connector.connector import SpoolConnector

    vcfg, kcfg = vllm_configs(str(tmp_path), groups, **extra)
    return SpoolConnector(vcfg, KVConnectorRole.SCHEDULER, kcfg)


def test_connector_startup_per_group_layout(tmp_path: Path):
    """Real vLLM specs: full + sliding is the grouped format (SupportsHMA); a kind vLLM
    classifies as chunked-local fails closed with one message, or disables the connector."""
    pytest.importorskip("vllm")
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
    )

    from spoolctl import metrics as m
    from spoolctl.connector.connector import SpoolConnector

    common = {"block_size": 32, "num_kv_heads": 2, "head_size": 16, "dtype": torch.float32}
    full, slide = FullAttentionSpec(**common), SlidingWindowSpec(**common, sliding_window=32)
    assert supports_hma(SpoolConnector)
    single = _scheduler_connector([full], tmp_path)
    hybrid = _scheduler_connector([slide, full], tmp_path)
    assert single.format.name == "single" and single.format.load_async
    assert hybrid.format.name == "grouped" and hybrid.format.load_async
    assert [(g.name, g.stored_blocks) for g in hybrid.format.layouts] == [("g0", 1), ("g1", 2)]
    assert single.namespace != hybrid.namespace

    local = ChunkedLocalAttentionSpec(**common, attention_chunk_size=64)
    with pytest.raises(ConfigError) as err:
        _scheduler_connector([slide, local], tmp_path)
    assert "chunked_local_attention" in err.value.message
    assert "spoolctl_on_unsupported" in str(err.value.fix) and "\n" not in str(err.value)
    off = _scheduler_connector([slide, local], tmp_path, spoolctl_on_unsupported="disable")
    req = _vllm_request("r", list(range(3, 203)), [])
    assert off.get_num_new_matched_tokens(req, 0) == (0, False)
    assert off.counters.totals()[m.LOOKUPS.name] == {"reason=disabled,result=bypass": 1}
    assert off.request_finished_all_groups(req, ([], [])) == (False, None)
