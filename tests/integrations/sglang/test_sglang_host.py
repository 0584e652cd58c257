"""SGLang host (HiCache) KV pools as decode's destination, and the seed errors
about them, through real sidecars.

Decode registers SGLang's own host pool (``MHATokenToKVPoolHost``, or
``AsymmetricMHATokenToKVPoolHost`` for head_dim != v_head_dim, built by
SGLang's ``get_mha_host_pool_cls`` on ``device="cpu"``) as its KV
destination; prefill sends from its device ``MHATokenToKVPool``. Both ranks
are built by SGLang's real ``PrefillBootstrapQueue`` / ``DecodePreallocQueue``
through the plugin's ``_init_kv_manager`` hook (:mod:`sglang_process`);
decode's host pools reach ``share_engine_memory`` as the hook calls it
(``host_destination``: the library entry point for a host destination, since
SGLang's own per-request host receive is refused at start). The oracle
reads the host buffer by SGLang's documented layout with plain tensor
indexing (never pd-transfer's view math) and compares every token of every
layer with the request's logical KV; everything else in the host buffer
stays zero.

The seeds (``shared/seeds/``):

- 002 "Unsupported layout for models with head_dim != v_head_dim and
  io_backend='direct': page_first; expected 'page_first_direct'" and
- 004 "Unsupported layout for models with head_dim != v_head_dim: <layout>"
  (``get_page_buffer_meta`` on a layer-first asymmetric pool):
  an asymmetric model (K head_dim 16, V head_dim 8) lands byte-exact in both
  layouts SGLang builds for it, page_first and page_first_direct; pd-transfer
  has no io-backend restriction on either. Layouts SGLang itself refuses for
  such a pool (layer_first, page_head) fail at SGLang's constructor, before
  pd-transfer is involved, and the test pins that message.
- 000 "Mamba storage zero-copy requires page_first layout, got <layout>": a
  Mamba2 hybrid's conv and temporal state land byte-exact in SGLang's own
  ``MambaPoolHost`` in both layouts it builds (page_first, page_first_direct);
  SGLang refuses any other layout at the pool's constructor, which the test
  pins.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool, MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
from sglang.srt.plugins import load_plugins
from sglang_deployment import Deployment, run_room
from sglang_process import Topology, host_destination, llama_dir, queue_rank, sglang_rank
from sglang_ranks import metadata_buffers

from pd_transfer.errors import GeometryError
from pd_transfer.integrations.sglang.facts import EngineFacts
from pd_transfer.integrations.sglang.host_views import host_kv_views
from pd_transfer.integrations.sglang.memory import HostKvPool, share_engine_memory

LAYERS, HEADS, PAGE, POOL_TOKENS = 3, 2, 4, 32
FACTS = EngineFacts(attn_tp_size=1, total_kv_heads=HEADS, model="tiny-host")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """One prefill and one decode sidecar for the module: each test registers its ranks anew
    (a worker whose connection closed may register again) and runs its own room."""
    load_plugins()
    sidecars = Deployment(tmp_path_factory.mktemp("host"), 1, 1)
    yield sidecars
    sidecars.close()


_rooms = itertools.count(61)


def device_pool(k_dim: int, v_dim: int) -> MHATokenToKVPool:
    extra = {} if k_dim == v_dim else {"v_head_dim": v_dim}
    return MHATokenToKVPool(
        size=POOL_TOKENS,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=HEADS,
        head_dim=k_dim,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        **extra,
    )


def host_pool(device: MHATokenToKVPool, layout: str):
    info = device.get_device_pool_infos()[0].buffer_info
    return get_mha_host_pool_cls(info)(
        info,
        2,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device.size,
        start_layer=0,
        end_layer=LAYERS,
    )


def host_tokens(pool, which: int, layer: int, tokens: list[int]) -> np.ndarray:
    """``[token, head, dim]`` of K (0) or V (1) for ``tokens``, read by SGLang's documented layout."""
    buf = pool.kv_buffer[which] if isinstance(pool.kv_buffer, (tuple, list)) else pool.kv_buffer[which]
    bits = buf.view(torch.int16)
    pages, offsets = [t // PAGE for t in tokens], [t % PAGE for t in tokens]
    if pool.layout == "layer_first":  # (L, S, H, D)
        return bits[layer, tokens].numpy()
    if pool.layout == "page_first":  # (S, L, H, D)
        return bits[tokens, layer].numpy()
    if pool.layout == "page_first_direct":  # (P, L, ps, H, D)
        return bits[pages, layer, offsets].numpy()
    if pool.layout == "page_head":  # (P, H, ps, L, D)
        return bits[pages, :, offsets, layer].numpy()
    raise AssertionError(pool.layout)


def queue_side(role: str, deployment, monkeypatch, model_dir: str, pool, **host_pools):
    """SGLang's queue for ``role`` built over ``pool`` through the plugin's hook; ``host_pools``
    (decode): the host pools registered as its destination."""
    monkeypatch.setenv("PD_TRANSFER_SGLANG_WORKER_ENDPOINT", deployment.endpoint(role, 0))
    with host_destination(**host_pools):
        return queue_rank(role, Topology(1), 0, model_dir, pool=pool, metadata=metadata_buffers())


def run_to_host(tmp_path, monkeypatch, deployment, layout: str, k_dim: int, v_dim: int):
    model_dir = llama_dir(tmp_path, "tiny-host", layers=LAYERS, kv_heads=HEADS, head_dim=k_dim)
    ranks = []
    try:
        ranks.append(queue_side("prefill", deployment, monkeypatch, model_dir, device_pool(k_dim, v_dim)))
        decode_device = device_pool(k_dim, v_dim)
        host = host_pool(decode_device, layout)
        ranks.append(
            queue_side("decode", deployment, monkeypatch, model_dir, decode_device, host_kv_pool=host)
        )
        prefill = ranks[0]
        src_pages, dst_pages = [2, 5, 1], [7, 3, 10]
        rng = np.random.default_rng(len(layout) * 7 + k_dim + v_dim)
        for buf in prefill.pool.k_buffer + prefill.pool.v_buffer:
            buf.view(torch.int16).copy_(
                torch.from_numpy(rng.integers(1, 2**15, size=tuple(buf.shape), dtype=np.int16))
            )
        p_states, d_states, _, receivers = run_room(
            [prefill],
            [ranks[1]],
            deployment,
            next(_rooms),
            src_pages,
            dst_pages,
            src_aux=0,
            dst_aux=1,
            chunk_pages=2,
        )
        assert d_states == [KVPoll.Success], [r.failure for r in receivers]
        assert p_states == [KVPoll.Success]
        src_tokens = [p * PAGE + t for p in src_pages for t in range(PAGE)]
        dst_tokens = [p * PAGE + t for p in dst_pages for t in range(PAGE)]
        for which, buffers in enumerate((prefill.pool.k_buffer, prefill.pool.v_buffer)):
            for layer, buf in enumerate(buffers):
                want = buf.view(torch.int16)[src_tokens].numpy()
                np.testing.assert_array_equal(
                    host_tokens(host, which, layer, dst_tokens),
                    want,
                    err_msg=f"{'kv'[which]} layer {layer} ({layout})",
                )
                others = [t for t in range(host.size) if t not in dst_tokens]
                assert not host_tokens(host, which, layer, others).any(), "bytes outside the request's pages"
        assert not decode_device.k_buffer[0].any(), "the device pool was written, not the host pool"
    finally:
        for rank in ranks:
            rank.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_kv_lands_byte_exact_in_sglangs_host_pool(tmp_path, monkeypatch, deployment, layout):
    run_to_host(tmp_path, monkeypatch, deployment, layout, 16, 16)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_seeds_002_004_asymmetric_head_dims_land_byte_exact_in_both_host_layouts(
    tmp_path, monkeypatch, deployment, layout
):
    run_to_host(tmp_path, monkeypatch, deployment, layout, 16, 8)


@pytest.mark.parametrize("layout", ["layer_first", "page_head"])
def test_seed_004_sglang_itself_refuses_other_asymmetric_host_layouts(layout):
    with pytest.raises(
        ValueError, match=f"head_dim != v_head_dim: {layout}; expected 'page_first' or 'page_first_direct'"
    ):
        host_pool(device_pool(16, 8), layout)


def test_a_host_layout_pd_transfer_cannot_address_is_refused_at_registration_naming_the_fix(tmp_path):
    device = device_pool(16, 16)
    memory = share_engine_memory(
        "hostref",
        kv_pool=device,
        metadata_buffers=metadata_buffers(),
        host_kv_pool=host_pool(device, "page_first"),
    )
    try:
        memory.host = HostKvPool("page_unified", PAGE, LAYERS)
        with pytest.raises(GeometryError, match="host pool layout 'page_unified'") as caught:
            host_kv_views(memory, FACTS, PAGE, 0)
        assert "--hicache-mem-layout" in str(caught.value.hint)
    finally:
        memory.close()


MAMBA_LAYERS = [1, 3]


def nemotron_h_dir(root) -> str:
    """A local NemotronH ``config.json``: attention on layers 0, 2, Mamba2 on 1, 3 (no weights)."""
    path = root / "tiny-nemotron-h"
    path.mkdir(exist_ok=True)
    config = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": HEADS,
        "head_dim": 8,
        "hybrid_override_pattern": "*M*M",
        "mamba_num_heads": 4,
        "mamba_head_dim": 4,
        "n_groups": 4,
        "ssm_state_size": 4,
        "conv_kernel": 4,
        "vocab_size": 128,
        "max_position_embeddings": 256,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def mamba_pools(model_dir: str):
    """SGLang's hybrid pools, the state sized by its ``NemotronHConfig`` at TP 1."""
    with sglang_rank("prefill", Topology(1), 0, model_path=model_dir):
        params = ModelConfig(model_dir).hf_config.mamba2_cache_params
    assert params.layers == MAMBA_LAYERS
    mamba = MambaPool(
        size=8, spec_state_size=0, cache_params=params, mamba_layer_ids=MAMBA_LAYERS, device="cpu"
    )
    kv = HybridLinearKVPool(
        size=POOL_TOKENS,
        dtype=torch.bfloat16,
        page_size=PAGE,
        head_num=HEADS,
        head_dim=8,
        full_attention_layer_ids=[0, 2],
        device="cpu",
        mamba_pool=mamba,
    )
    return mamba, kv


def mamba_host(mamba: MambaPool, layout: str) -> MambaPoolHost:
    info = mamba.get_device_pool_infos()[0].buffer_info
    return MambaPoolHost(
        info, 2, 0, device_capacity=mamba.size, pin_memory=False, device="cpu", layout=layout
    )


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_seed_000_mamba_state_lands_byte_exact_in_sglangs_host_pool(
    tmp_path, monkeypatch, deployment, layout
):
    model_dir = nemotron_h_dir(tmp_path)
    ranks = []
    try:
        mamba, kv = mamba_pools(model_dir)
        ranks.append(queue_side("prefill", deployment, monkeypatch, model_dir, kv))
        d_mamba, d_kv = mamba_pools(model_dir)
        host = mamba_host(d_mamba, layout)
        ranks.append(queue_side("decode", deployment, monkeypatch, model_dir, d_kv, host_mamba_pool=host))
        cache = mamba.mamba_cache
        rng = np.random.default_rng(0)
        for buf in [cache.temporal, *cache.conv]:
            buf.copy_(torch.from_numpy(rng.standard_normal(tuple(buf.shape))).to(buf.dtype))
        src_slot, dst_slot = 2, 6
        p_states, d_states, _, receivers = run_room(
            [ranks[0]],
            [ranks[1]],
            deployment,
            next(_rooms),
            [1, 3],
            [2, 5],
            src_aux=0,
            dst_aux=1,
            src_state=[np.array([src_slot])],
            dst_state=[np.array([dst_slot])],
        )
        assert d_states == [KVPoll.Success], [r.failure for r in receivers]
        assert p_states == [KVPoll.Success]
        for position in range(len(MAMBA_LAYERS)):  # host (slots, Lm, 1, *shape); device (Lm, slots, *shape)
            for name, src, dst in [
                ("temporal", cache.temporal, host.temporal_buffer),
                *(("conv", c, h) for c, h in zip(cache.conv, host.conv_buffer)),
            ]:
                assert torch.equal(dst[dst_slot, position, 0], src[position, src_slot]), (
                    f"{name} layer {position}"
                )
                others = [s for s in range(dst.shape[0]) if s != dst_slot]
                assert not dst[others].any(), f"{name}: a host slot the room did not name was written"
        assert not d_mamba.mamba_cache.temporal.any(), "the device state was written, not the host pool"
    finally:
        for rank in ranks:
            rank.close()


def test_seed_000_sglang_itself_refuses_a_layer_first_mamba_host_pool(tmp_path):
    with pytest.raises(AssertionError, match="Unsupported layout: layer_first"):
        mamba_host(mamba_pools(nemotron_h_dir(tmp_path))[0], "layer_first")
