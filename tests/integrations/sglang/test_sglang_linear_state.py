"""Linear-attention hybrids through SGLang's ``HybridLinearKVPool`` + ``MambaPool``,
its real queues and real sidecars: a NemotronH Mamba2 model, prefill TP 1 ->
decode TP 2, and a Qwen3-Next GDN model, TP 2 -> 4.

Every rank is built as SGLang's scheduler builds it (:mod:`sglang_process`):
the state shapes come from the ``mamba2_cache_params`` of SGLang's own config
class for a local ``config.json`` (``NemotronHConfig``, ``Qwen3NextConfig``)
at the rank's attention TP, and SGLang's real ``PrefillBootstrapQueue`` /
``DecodePreallocQueue`` run its ``_init_kv_manager`` through the plugin's
hook, which reads ``n_groups`` and the cache params from that config.

SGLang declares no conv groups for Mamba2 models, but a Mamba2 conv state's
channels are ``[x (d_inner) | B (n_groups*state) | C (n_groups*state)]``, each
sharded on its own across TP; the hook supplies the groups. The oracle lays
out the logical state independently and checks every decode slot, and the
test shows that a contiguous slice of prefill's channels (what a backend
without the groups moves) differs. For GDN, SGLang declares the groups
itself: ``[q (key_dim) | k (key_dim) | v (value_dim)]``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool
from sglang.srt.plugins import load_plugins
from sglang_deployment import Deployment, run_room
from sglang_process import Topology, queue_rank, sglang_rank
from sglang_ranks import metadata_buffers

KV_HEADS, HEAD_DIM, PAGE_SIZE, POOL_TOKENS = 2, 8, 4, 32
D_INNER, N_GROUPS, STATE, M_HEADS, M_HEAD_DIM, KERNEL = 16, 4, 4, 4, 4, 4
CONV_DIM = D_INNER + 2 * N_GROUPS * STATE


KEY_DIM = N_GROUPS * STATE
GROUPS = {"mamba2": (D_INNER, KEY_DIM, KEY_DIM), "gdn": (KEY_DIM, KEY_DIM, D_INNER)}
CONFIGS = {  # the model's config.json beyond what both share
    "mamba2": {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hybrid_override_pattern": "*M*M",  # attention on layers 0, 2; Mamba2 on 1, 3
        "mamba_num_heads": M_HEADS,
        "mamba_head_dim": M_HEAD_DIM,
        "n_groups": N_GROUPS,
        "ssm_state_size": STATE,
        "conv_kernel": KERNEL,
    },
    "gdn": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "num_hidden_layers": 4,
        "full_attention_interval": 2,  # GDN on layers 0, 2; attention on 1, 3
        "linear_num_key_heads": N_GROUPS,
        "linear_key_head_dim": STATE,
        "linear_num_value_heads": M_HEADS,
        "linear_value_head_dim": M_HEAD_DIM,
        "linear_conv_kernel_dim": KERNEL,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
}


def model_dir(root, model: str) -> str:
    """A local ``config.json`` of ``model`` (no weights: only its config is read)."""
    path = root / f"tiny-{model}"
    path.mkdir(exist_ok=True)
    config = {
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": 128,
        "max_position_embeddings": 256,
        "torch_dtype": "bfloat16",
        **CONFIGS[model],
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def hybrid_rank(role: str, tp_rank: int, tp_size: int, deployment, monkeypatch, path: str):
    """SGLang's pools sized by its config class at this rank's TP, then its queue over them."""
    monkeypatch.setenv("PD_TRANSFER_SGLANG_WORKER_ENDPOINT", deployment.endpoint(role, tp_rank))
    with sglang_rank(role, Topology(tp_size), tp_rank, model_path=path):
        hf_config = ModelConfig(path).hf_config
        params = hf_config.mamba2_cache_params
        attention = [i for i in range(4) if i not in params.layers]
    mamba = MambaPool(
        size=4, spec_state_size=0, cache_params=params, mamba_layer_ids=params.layers, device="cpu"
    )
    pool = HybridLinearKVPool(
        size=POOL_TOKENS,
        dtype=torch.bfloat16,
        page_size=PAGE_SIZE,
        head_num=max(1, KV_HEADS // tp_size),
        head_dim=HEAD_DIM,
        full_attention_layer_ids=attention,
        device="cpu",
        mamba_pool=mamba,
    )
    rank = queue_rank(role, Topology(tp_size), tp_rank, path, pool=pool, metadata=metadata_buffers())
    rank.mamba_pool, rank.mamba_layers = mamba, list(params.layers)
    return rank


def local_channels(tp_rank: int, tp_size: int, model: str) -> np.ndarray:
    """Global conv channel ids rank ``tp_rank`` holds: each group split on its own."""
    out, start = [], 0
    for group in GROUPS[model]:
        per = group // tp_size
        out.append(np.arange(start + tp_rank * per, start + (tp_rank + 1) * per))
        start += group
    return np.concatenate(out)


@pytest.mark.parametrize(("model", "prefill_tp", "decode_tp"), [("mamba2", 1, 2), ("gdn", 2, 4)])
def test_conv_groups_land_per_group_across_tp(tmp_path, monkeypatch, model, prefill_tp, decode_tp):
    load_plugins()
    path = model_dir(tmp_path, model)
    deployment = Deployment(tmp_path, prefill_tp, decode_tp)
    prefill = decode = []
    try:
        prefill = [
            hybrid_rank("prefill", r, prefill_tp, deployment, monkeypatch, path) for r in range(prefill_tp)
        ]
        decode = [
            hybrid_rank("decode", r, decode_tp, deployment, monkeypatch, path) for r in range(decode_tp)
        ]
        mamba_layers = prefill[0].mamba_layers  # the model's, from its config
        assert mamba_layers == ([1, 3] if model == "mamba2" else [0, 2])
        rng = np.random.default_rng(7)
        conv = {
            layer: rng.standard_normal((CONV_DIM, KERNEL - 1)).astype(np.float32) for layer in mamba_layers
        }
        temporal = {
            layer: rng.standard_normal((M_HEADS, M_HEAD_DIM, STATE)).astype(np.float32)
            for layer in mamba_layers
        }
        src_slot, dst_slot = 1, 2
        for rank in prefill:
            cache = rank.mamba_pool.mamba_cache
            channels = local_channels(rank.tp_rank, prefill_tp, model)
            heads = slice(rank.tp_rank * M_HEADS // prefill_tp, (rank.tp_rank + 1) * M_HEADS // prefill_tp)
            for i, layer in enumerate(mamba_layers):
                cache.conv[0][i, src_slot] = torch.from_numpy(conv[layer][channels]).to(cache.conv[0].dtype)
                cache.temporal[i, src_slot] = torch.from_numpy(temporal[layer][heads]).to(
                    cache.temporal.dtype
                )
        pages = [1, 3]
        p_states, d_states, _, receivers = run_room(
            prefill,
            decode,
            deployment,
            77,
            pages,
            [2, 5],
            src_aux=0,
            dst_aux=1,
            src_state=[np.array([src_slot])],
            dst_state=[np.array([dst_slot])],
        )
        assert d_states == [KVPoll.Success] * decode_tp, [r.failure for r in receivers]
        assert p_states == [KVPoll.Success] * prefill_tp
        full_conv = {
            layer: torch.from_numpy(conv[layer]).to(torch.bfloat16).float().numpy() for layer in mamba_layers
        }
        for rank in decode:
            got = rank.mamba_pool.mamba_cache
            channels = local_channels(rank.tp_rank, decode_tp, model)
            heads = slice(rank.tp_rank * M_HEADS // decode_tp, (rank.tp_rank + 1) * M_HEADS // decode_tp)
            for i, layer in enumerate(mamba_layers):
                want = torch.from_numpy(conv[layer]).to(got.conv[0].dtype).float().numpy()[channels]
                landed = got.conv[0][i, dst_slot].float().numpy()
                np.testing.assert_array_equal(landed, want, err_msg=f"conv layer {layer} rank {rank.tp_rank}")
                # what slicing the concatenated channels as one range would have moved
                part = CONV_DIM // decode_tp
                contiguous = full_conv[layer][rank.tp_rank * part : (rank.tp_rank + 1) * part]
                assert not np.array_equal(landed, contiguous), "a contiguous slice would have matched"
                np.testing.assert_array_equal(
                    got.temporal[i, dst_slot].float().numpy(),
                    torch.from_numpy(temporal[layer]).to(got.temporal.dtype).float().numpy()[heads],
                )
                assert not got.conv[0][i, src_slot].any(), "a slot the room did not name was written"
    finally:
        for rank in prefill + decode:
            rank.close()
        deployment.close()
