"""A gpt-oss-style model, sliding-window layers between full-attention layers,
prefill TP 1 -> decode TP 2, through SGLang's ``SWAKVPool`` and real sidecars.

SGLang sends full-attention pages as KV and the window's pages as the SWA state
component; its ``kv_args`` carry no layer ids for them, so the backend takes
each sub-pool position's model layer from the pool's own mapping. The oracle:
every decode rank's full pages and window pages hold exactly its heads of the
request's bytes, and nothing else changed.
"""

from __future__ import annotations

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang_deployment import Deployment, run_room
from sglang_ranks import build_rank

from pd_transfer.integrations.sglang.registration import EngineFacts

SWA_LAYERS, FULL_LAYERS = [0, 2], [1, 3]
KV_HEADS, HEAD_DIM, PAGE_SIZE = 2, 8, 4


def swa_rank(role: str, tp_rank: int, tp_size: int, deployment, monkeypatch):
    monkeypatch.setenv("PD_TRANSFER_SGLANG_WORKER_ENDPOINT", deployment.endpoint(role, tp_rank))
    pool = SWAKVPool(
        size=48,
        size_swa=32,
        page_size=PAGE_SIZE,
        dtype=torch.bfloat16,
        head_num=KV_HEADS // tp_size,
        head_dim=HEAD_DIM,
        swa_attention_layer_ids=SWA_LAYERS,
        full_attention_layer_ids=FULL_LAYERS,
        device="cpu",
    )
    return build_rank(
        role,
        tp_rank,
        pool,
        page_size=PAGE_SIZE,
        num_layers=4,
        owner=f"swa-{role}{tp_rank}",
        facts=EngineFacts(attn_tp_size=tp_size, total_kv_heads=KV_HEADS, model="tiny-gpt-oss"),
    )


def fill(sub_pool, pages, data, heads):
    for which, buffers in enumerate((sub_pool.k_buffer, sub_pool.v_buffer)):
        for position, buf in enumerate(buffers):
            bits = buf.view(torch.int16)
            for i, page in enumerate(pages):
                bits[page * PAGE_SIZE : (page + 1) * PAGE_SIZE] = torch.from_numpy(
                    data[which, position, i * PAGE_SIZE : (i + 1) * PAGE_SIZE, heads]
                )


def check(sub_pool, pages, data, heads, what):
    for which, buffers in enumerate((sub_pool.k_buffer, sub_pool.v_buffer)):
        for position, buf in enumerate(buffers):
            got = buf.view(torch.int16).numpy().reshape(-1, PAGE_SIZE, buf.shape[1], HEAD_DIM)
            for i, page in enumerate(pages):
                np.testing.assert_array_equal(
                    got[page],
                    data[which, position, i * PAGE_SIZE : (i + 1) * PAGE_SIZE, heads],
                    err_msg=f"{what} {'kv'[which]}{position}",
                )
            assert not got[[p for p in range(got.shape[0]) if p not in pages]].any(), what


def test_window_pages_and_full_pages_land_byte_exact(tmp_path, monkeypatch):
    deployment = Deployment(tmp_path, 1, 2)
    prefill = decode = []
    try:
        prefill = [swa_rank("prefill", 0, 1, deployment, monkeypatch)]
        decode = [swa_rank("decode", r, 2, deployment, monkeypatch) for r in range(2)]
        rng = np.random.default_rng(11)
        src_pages, dst_pages = [2, 6, 3, 8], [5, 1, 9, 4]
        src_window, dst_window = [7, 1], [3, 6]  # the window: the last two pages' tokens
        full = rng.integers(
            1, 2**15, size=(2, 2, len(src_pages) * PAGE_SIZE, KV_HEADS, HEAD_DIM), dtype=np.int16
        )
        window = rng.integers(
            1, 2**15, size=(2, 2, len(src_window) * PAGE_SIZE, KV_HEADS, HEAD_DIM), dtype=np.int16
        )
        fill(prefill[0].pool.full_kv_pool, src_pages, full, slice(None))
        fill(prefill[0].pool.swa_kv_pool, src_window, window, slice(None))
        p_states, d_states, _, receivers = run_room(
            prefill,
            decode,
            deployment,
            123,
            src_pages,
            dst_pages,
            src_aux=0,
            dst_aux=3,
            src_state=[np.array(src_window)],
            dst_state=[np.array(dst_window)],
        )
        assert d_states == [KVPoll.Success] * 2, [r.failure for r in receivers]
        assert p_states == [KVPoll.Success]
        for rank in decode:
            heads = slice(rank.tp_rank, rank.tp_rank + 1)
            check(rank.pool.full_kv_pool, dst_pages, full, heads, f"rank {rank.tp_rank} full")
            check(rank.pool.swa_kv_pool, dst_window, window, heads, f"rank {rank.tp_rank} window")
        views = {v.path for v in prefill[0].manager.geometry.views}
        assert {"swa.layer[0].k", "swa.layer[2].v", "kv.layer[1].k", "kv.layer[3].v"} <= views
    finally:
        for rank in prefill + decode:
            rank.close()
        deployment.close()
