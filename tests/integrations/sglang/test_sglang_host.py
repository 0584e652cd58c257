"""SGLang host (HiCache) KV pools as decode's destination, and the seed errors
about them, through real sidecars.

Decode registers SGLang's own host pool (``MHATokenToKVPoolHost``, or
``AsymmetricMHATokenToKVPoolHost`` for head_dim != v_head_dim, built by
SGLang's ``get_mha_host_pool_cls`` on ``device="cpu"``) as its KV
destination; prefill sends from its device ``MHATokenToKVPool``. The oracle
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
- 000 (Mamba host storage needs page_first) is a host Mamba pool; host
  destinations for state are not registered by this backend yet (docs/sglang.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
from sglang_deployment import Deployment, run_room
from sglang_ranks import build_rank, metadata_buffers

from pd_transfer.errors import GeometryError
from pd_transfer.integrations.sglang.host_views import host_kv_views
from pd_transfer.integrations.sglang.memory import HostKvPool, share_engine_memory
from pd_transfer.integrations.sglang.registration import EngineFacts

LAYERS, HEADS, PAGE, POOL_TOKENS = 3, 2, 4, 32
FACTS = EngineFacts(attn_tp_size=1, total_kv_heads=HEADS, model="tiny-host")


def device_pool(k_dim: int, v_dim: int) -> MHATokenToKVPool:
    extra = {} if k_dim == v_dim else {"v_head_dim": v_dim}
    return MHATokenToKVPool(size=POOL_TOKENS, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS, head_dim=k_dim,
                            layer_num=LAYERS, device="cpu", enable_memory_saver=False, **extra)


def host_pool(device: MHATokenToKVPool, layout: str):
    info = device.get_device_pool_infos()[0].buffer_info
    return get_mha_host_pool_cls(info)(info, 2, 0, PAGE, layout, pin_memory=False, device="cpu",
                                       device_capacity_tokens=device.size, start_layer=0, end_layer=LAYERS)


def host_tokens(pool, which: int, layer: int, tokens: list[int]) -> np.ndarray:
    """``[token, head, dim]`` of K (0) or V (1) for ``tokens``, read by SGLang's documented layout."""
    buf = pool.kv_buffer[which] if isinstance(pool.kv_buffer, (tuple, list)) else pool.kv_buffer[which]
    bits = buf.view(torch.int16)
    pages, offsets = [t // PAGE for t in tokens], [t % PAGE for t in tokens]
    if pool.layout == "layer_first":          # (L, S, H, D)
        return bits[layer, tokens].numpy()
    if pool.layout == "page_first":           # (S, L, H, D)
        return bits[tokens, layer].numpy()
    if pool.layout == "page_first_direct":    # (P, L, ps, H, D)
        return bits[pages, layer, offsets].numpy()
    if pool.layout == "page_head":            # (P, H, ps, L, D)
        return bits[pages, :, offsets, layer].numpy()
    raise AssertionError(pool.layout)


def run_to_host(tmp_path, monkeypatch, layout: str, k_dim: int, v_dim: int, tag: str):
    deployment = Deployment(tmp_path, 1, 1)
    ranks = []
    try:
        monkeypatch.setenv("PD_TRANSFER_SGLANG_WORKER_ENDPOINT", deployment.endpoint("prefill", 0))
        ranks.append(build_rank("prefill", 0, device_pool(k_dim, v_dim), page_size=PAGE, num_layers=LAYERS,
                                facts=FACTS, owner=f"{tag}-p"))
        decode_device = device_pool(k_dim, v_dim)
        host = host_pool(decode_device, layout)
        monkeypatch.setenv("PD_TRANSFER_SGLANG_WORKER_ENDPOINT", deployment.endpoint("decode", 0))
        ranks.append(build_rank("decode", 0, decode_device, page_size=PAGE, num_layers=LAYERS, facts=FACTS,
                                owner=f"{tag}-d", host_kv_pool=host))
        prefill = ranks[0]
        src_pages, dst_pages = [2, 5, 1], [7, 3, 10]
        rng = np.random.default_rng(len(layout) * 7 + k_dim + v_dim)
        for buf in prefill.pool.k_buffer + prefill.pool.v_buffer:
            buf.view(torch.int16).copy_(torch.from_numpy(
                rng.integers(1, 2**15, size=tuple(buf.shape), dtype=np.int16)))
        p_states, d_states, _, receivers = run_room([prefill], [ranks[1]], deployment, 61, src_pages, dst_pages,
                                                    src_aux=0, dst_aux=1, chunk_pages=2)
        assert d_states == [KVPoll.Success], [r.failure for r in receivers]
        assert p_states == [KVPoll.Success]
        src_tokens = [p * PAGE + t for p in src_pages for t in range(PAGE)]
        dst_tokens = [p * PAGE + t for p in dst_pages for t in range(PAGE)]
        for which, buffers in enumerate((prefill.pool.k_buffer, prefill.pool.v_buffer)):
            for layer, buf in enumerate(buffers):
                want = buf.view(torch.int16)[src_tokens].numpy()
                np.testing.assert_array_equal(host_tokens(host, which, layer, dst_tokens), want,
                                              err_msg=f"{'kv'[which]} layer {layer} ({layout})")
                others = [t for t in range(host.size) if t not in dst_tokens]
                assert not host_tokens(host, which, layer, others).any(), "bytes outside the request's pages"
        assert not decode_device.k_buffer[0].any(), "the device pool was written, not the host pool"
    finally:
        for rank in ranks:
            rank.close()
        deployment.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_kv_lands_byte_exact_in_sglangs_host_pool(tmp_path, monkeypatch, layout):
    run_to_host(tmp_path, monkeypatch, layout, 16, 16, f"h-{layout}")


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_seeds_002_004_asymmetric_head_dims_land_byte_exact_in_both_host_layouts(tmp_path, monkeypatch, layout):
    run_to_host(tmp_path, monkeypatch, layout, 16, 8, f"a-{layout}")


@pytest.mark.parametrize("layout", ["layer_first", "page_head"])
def test_seed_004_sglang_itself_refuses_other_asymmetric_host_layouts(layout):
    with pytest.raises(ValueError, match=f"head_dim != v_head_dim: {layout}; expected 'page_first' or "
                                         f"'page_first_direct'"):
        host_pool(device_pool(16, 8), layout)


def test_a_host_layout_pd_transfer_cannot_address_is_refused_at_registration_naming_the_fix(tmp_path):
    device = device_pool(16, 16)
    memory = share_engine_memory("hostref", kv_pool=device, metadata_buffers=metadata_buffers(),
                                 host_kv_pool=host_pool(device, "page_first"))
    try:
        memory.host = HostKvPool("page_unified", PAGE, LAYERS)
        with pytest.raises(GeometryError, match="host pool layout 'page_unified'") as caught:
            host_kv_views(memory, FACTS, PAGE, 0)
        assert "--hicache-mem-layout" in str(caught.value.hint)
    finally:
        memory.close()
