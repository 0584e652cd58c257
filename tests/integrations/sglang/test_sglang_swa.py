"""A gpt-oss model, sliding-window layers between full-attention layers,
prefill TP 1 -> decode TP 2, through SGLang's ``SWAKVPool``, its real queues
and real sidecars.

Every rank is built as SGLang's scheduler builds it (:mod:`sglang_process`):
the window and full layers come from the ``ModelConfig`` of a local gpt-oss
``config.json``, SGLang's real ``PrefillBootstrapQueue`` /
``DecodePreallocQueue`` run its ``_init_kv_manager`` through the plugin's
hook, which fills ``kv_args`` (full-attention pages as KV, the window's pages
as the SWA state component, with no layer ids for them: the backend takes each
sub-pool position's model layer from the pool's own mapping). The oracle:
every decode rank's full pages and window pages hold exactly its heads of the
request's bytes, and nothing else changed.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.plugins import load_plugins
from sglang_deployment import Deployment, run_room
from sglang_process import Topology, queue_rank
from sglang_ranks import metadata_buffers

KV_HEADS, HEAD_DIM, PAGE_SIZE = 2, 8, 4


def gpt_oss_dir(root) -> str:
    """A local gpt-oss ``config.json`` (layers 0, 2 sliding-window; 1, 3 full); no weights."""
    path = root / "tiny-gpt-oss"
    path.mkdir()
    config = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": 4,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "vocab_size": 128,
        "max_position_embeddings": 256,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def swa_rank(role: str, tp_rank: int, tp_size: int, deployment, monkeypatch, model_dir: str):
    monkeypatch.setenv("PD_TRANSFER_SGLANG_WORKER_ENDPOINT", deployment.endpoint(role, tp_rank))
    model = ModelConfig(model_dir)
    pool = SWAKVPool(
        size=48,
        size_swa=32,
        page_size=PAGE_SIZE,
        dtype=torch.bfloat16,
        head_num=KV_HEADS // tp_size,
        head_dim=HEAD_DIM,
        swa_attention_layer_ids=model.swa_attention_layer_ids,
        full_attention_layer_ids=model.full_attention_layer_ids,
        device="cpu",
    )
    return queue_rank(role, Topology(tp_size), tp_rank, model_dir, pool=pool, metadata=metadata_buffers())


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
    load_plugins()
    model_dir = gpt_oss_dir(tmp_path)
    deployment = Deployment(tmp_path, 1, 2)
    prefill = decode = []
    try:
        prefill = [swa_rank("prefill", 0, 1, deployment, monkeypatch, model_dir)]
        decode = [swa_rank("decode", r, 2, deployment, monkeypatch, model_dir) for r in range(2)]
        assert [getattr(t, "value", t) for t in prefill[0].manager.kv_args.state_types] == ["swa"]
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
