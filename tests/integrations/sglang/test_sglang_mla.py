"""DeepSeek-style MLA with an MTP draft layer, prefill TP 4 -> decode TP 2, through
SGLang's ``MLATokenToKVPool`` (target and draft), its real queues and real sidecars.

Every rank is built as SGLang's scheduler builds it (:mod:`sglang_process`):
SGLang's published server args with ``--speculative-algorithm EAGLE`` (what
SGLang runs DeepSeek's MTP as) and the model's own draft, its parallel
state, then its real ``PrefillBootstrapQueue`` / ``DecodePreallocQueue``,
whose constructors run SGLang's ``_init_kv_manager`` through the plugin's
hook: SGLang fills ``kv_args`` (the target's latents, then the draft's,
``num_draft_entries``) and the hook reads ``engine_facts`` from the
``ModelConfig`` of a local DeepSeek-V3 ``config.json``.

Every rank holds the whole latent (kv_lora_rank + qk_rope_head_dim per
token) of both models; the oracle is the request's logical latents
``[layer, token, dim]`` of the target and of the draft, and every decode rank
must end with exactly them on its pages, by plain indexing of SGLang's
buffers, and nothing anywhere else.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import MetadataBuffers
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.plugins import load_plugins
from sglang_deployment import Deployment, run_room
from sglang_process import Topology, queue_rank
from sglang_ranks import NUM_AUX_ROWS

LAYERS, DRAFT_LAYERS, LORA, ROPE, PAGE_SIZE, POOL_TOKENS, HIDDEN = 2, 1, 32, 8, 4, 48, 64


def deepseek_dir(root) -> str:
    """A local DeepSeek-V3 ``config.json`` (MLA, one MTP layer); no weights, only the config is read."""
    path = root / "tiny-deepseek"
    path.mkdir()
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": HIDDEN,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": LAYERS,
        "kv_lora_rank": LORA,
        "q_lora_rank": 16,
        "qk_rope_head_dim": ROPE,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "num_nextn_predict_layers": DRAFT_LAYERS,
        "vocab_size": 128,
        "max_position_embeddings": 256,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def mla_pool(layers: int, start_layer: int = 0) -> MLATokenToKVPool:
    return MLATokenToKVPool(
        size=POOL_TOKENS,
        page_size=PAGE_SIZE,
        dtype=torch.bfloat16,
        kv_lora_rank=LORA,
        qk_rope_head_dim=ROPE,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        start_layer=start_layer,
    )


def mla_rank(role: str, tp_rank: int, tp_size: int, deployment, monkeypatch, model_dir: str):
    monkeypatch.setenv("PD_TRANSFER_SGLANG_WORKER_ENDPOINT", deployment.endpoint(role, tp_rank))
    metadata = MetadataBuffers(  # as SGLang sizes them for a speculative draft: the hidden state
        size=NUM_AUX_ROWS,
        hidden_size=HIDDEN,
        hidden_states_dtype=torch.bfloat16,
        max_sampling_mask_tokens=4,
        max_top_logprobs_num=4,
    )
    return queue_rank(
        role,
        Topology(tp_size),
        tp_rank,
        model_dir,
        pool=mla_pool(LAYERS),
        metadata=metadata,
        draft_pool=mla_pool(DRAFT_LAYERS, start_layer=LAYERS),  # the MTP layer follows the target's
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=model_dir,
    )


def write_latents(pool: MLATokenToKVPool, latent: np.ndarray, pages: list[int]) -> None:
    for layer, buf in enumerate(pool.kv_buffer):
        bits = buf.view(torch.int16)
        for i, page in enumerate(pages):
            rows = slice(page * PAGE_SIZE, (page + 1) * PAGE_SIZE)
            bits[rows, 0] = torch.from_numpy(latent[layer, i * PAGE_SIZE : (i + 1) * PAGE_SIZE])


def check_latents(pool: MLATokenToKVPool, latent: np.ndarray, pages: list[int], what: str) -> None:
    for layer, buf in enumerate(pool.kv_buffer):
        got = buf.view(torch.int16).numpy().reshape(-1, PAGE_SIZE, LORA + ROPE)
        for i, page in enumerate(pages):
            np.testing.assert_array_equal(
                got[page], latent[layer, i * PAGE_SIZE : (i + 1) * PAGE_SIZE], err_msg=f"{what} layer {layer}"
            )
        others = [p for p in range(got.shape[0]) if p not in pages]
        assert not got[others].any(), f"{what} layer {layer}: bytes outside the request's pages"


def test_mla_and_mtp_draft_latents_land_on_every_decode_rank(tmp_path, monkeypatch):
    load_plugins()
    model_dir = deepseek_dir(tmp_path)
    deployment = Deployment(tmp_path, 4, 2)
    prefill = decode = []
    try:
        prefill = [mla_rank("prefill", r, 4, deployment, monkeypatch, model_dir) for r in range(4)]
        decode = [mla_rank("decode", r, 2, deployment, monkeypatch, model_dir) for r in range(2)]
        assert (
            prefill[0].queue.is_mla_backend and prefill[0].manager.kv_args.num_draft_entries == DRAFT_LAYERS
        )
        paths = {v.path for v in decode[0].manager.geometry.views}
        assert {"kv.layer[0].latent", "kv.layer[1].latent", "kv.layer[0].draft_latent"} <= paths, paths
        src_pages, dst_pages = [2, 5, 1], [7, 3, 10]
        rng = np.random.default_rng(3)
        tokens = len(src_pages) * PAGE_SIZE
        target = rng.integers(1, 2**15, size=(LAYERS, tokens, LORA + ROPE), dtype=np.int16)
        draft = rng.integers(1, 2**15, size=(DRAFT_LAYERS, tokens, LORA + ROPE), dtype=np.int16)
        hidden = torch.from_numpy(rng.integers(1, 2**15, size=HIDDEN, dtype=np.int16)).view(torch.bfloat16)
        for rank in prefill:
            write_latents(rank.pool, target, src_pages)
            write_latents(rank.draft_pool, draft, src_pages)
            rank.metadata.output_hidden_states[1] = hidden  # the MTP layer's input on decode
            rank.metadata.bootstrap_room[1, 0] = 31
        p_states, d_states, _, receivers = run_room(
            prefill, decode, deployment, 31, src_pages, dst_pages, src_aux=1, dst_aux=2
        )
        assert d_states == [KVPoll.Success] * 2, [r.failure for r in receivers]
        assert p_states == [KVPoll.Success] * 4
        for rank in decode:
            check_latents(rank.pool, target, dst_pages, f"target rank {rank.tp_rank}")
            check_latents(rank.draft_pool, draft, dst_pages, f"MTP draft rank {rank.tp_rank}")
            row = rank.metadata
            assert torch.equal(row.output_hidden_states[2].view(torch.int16), hidden.view(torch.int16))
            assert int(row.bootstrap_room[2, 0]) == 31
    finally:
        for rank in prefill + decode:
            rank.close()
        deployment.close()
