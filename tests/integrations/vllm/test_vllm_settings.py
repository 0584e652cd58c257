"""vLLM settings the connector supports or refuses at start, with vLLM's own config objects."""

from __future__ import annotations

import json

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed here: run tests/integrations/vllm with the "
    "python printed by .ci/engine-venv-vllm",
)

from conftest import TINY_LLAMA  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm_harness import attention_cache_config, vllm_config  # noqa: E402

from pd_transfer.errors import ConfigError  # noqa: E402
from pd_transfer.integrations.vllm.connector import PdTransferConnector  # noqa: E402

BOOTSTRAP = "tcp://127.0.0.1:7321"
ROLES = [("kv_producer", {"bootstrap_addr": BOOTSTRAP}), ("kv_consumer", {})]
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]

# a DeepSeek-V3-shaped config with two MTP modules (config only: vLLM's configs need no weights)
TINY_DEEPSEEK_MTP = {
    **TINY_LLAMA,
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 32,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "num_nextn_predict_layers": 2,
    "routed_scaling_factor": 1.0,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
}


def _connector(config, role=KVConnectorRole.SCHEDULER):
    return PdTransferConnector(config, role, attention_cache_config(LAYERS, num_blocks=64))


@pytest.mark.parametrize("kv_role, extra", ROLES)
@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_pipeline_parallel_is_refused_at_start_naming_the_setting(model_dir, kv_role, extra, role):
    config = vllm_config(model_dir, kv_role=kv_role, extra=extra, parallel={"pipeline_parallel_size": 2})
    with pytest.raises(ConfigError, match=r"parallel_config\.pipeline_parallel_size=2: "):
        _connector(config, role)


def test_decode_context_parallel_is_refused_naming_the_setting(tmp_path):
    # vLLM's DCP needs more TP ranks than KV heads: 8 query heads, 2 KV heads, TP 4
    (tmp_path / "config.json").write_text(
        json.dumps({**TINY_LLAMA, "num_attention_heads": 8, "num_key_value_heads": 2})
    )
    config = vllm_config(
        tmp_path, kv_role="kv_consumer", tp_size=4, parallel={"decode_context_parallel_size": 2}
    )
    with pytest.raises(ConfigError, match=r"parallel_config\.decode_context_parallel_size=2: .*split"):
        _connector(config)


def test_data_parallel_needs_a_sidecar_per_engine_named_by_dp_rank(model_dir):
    dp = {"data_parallel_size": 2, "data_parallel_rank": 1}
    shared = vllm_config(
        model_dir,
        kv_role="kv_producer",
        extra={"bootstrap_addr": BOOTSTRAP, "worker_endpoint": "unix:///run/pd/p{tp_rank}.sock"},
        parallel=dp,
    )
    with pytest.raises(
        ConfigError,
        match=r"parallel_config\.data_parallel_size=2 with kv_connector_extra_config\.worker_endpoint "
        r"and bootstrap_addr lacking '\{dp_rank\}'",
    ):
        _connector(shared)
    own = vllm_config(
        model_dir,
        kv_role="kv_producer",
        extra={
            "bootstrap_addr": "tcp://127.0.0.1:73{dp_rank}0",
            "worker_endpoint": "unix:///run/pd/p-dp{dp_rank}-tp{tp_rank}.sock",
        },
        parallel=dp,
    )
    # DP rank 1's engine returns its own prefill instance's bootstrap address to the router
    assert _connector(own)._scheduler.bootstrap_addr == "tcp://127.0.0.1:7310"
    decode = vllm_config(
        model_dir, kv_role="kv_consumer", extra={"worker_endpoint": "unix:///d-dp{dp_rank}.sock"}, parallel=dp
    )
    assert _connector(decode)._scheduler is not None


def test_eagle_draft_layers_are_accepted_and_multi_module_mtp_is_refused(model_dir, tmp_path):
    eagle = vllm_config(
        model_dir,
        kv_role="kv_consumer",
        speculative={"method": "eagle", "model": str(model_dir), "num_speculative_tokens": 3},
    )
    assert _connector(eagle)._scheduler is not None
    (tmp_path / "config.json").write_text(json.dumps(TINY_DEEPSEEK_MTP))
    mtp = vllm_config(
        tmp_path,
        kv_role="kv_producer",
        extra={"bootstrap_addr": BOOTSTRAP},
        speculative={"method": "mtp", "num_speculative_tokens": 2},
    )
    assert mtp.num_prefill_lookahead_tokens == 2  # vLLM's own reading: two tokens ahead
    with pytest.raises(
        ConfigError,
        match=r"speculative_config\.method='mtp' with num_speculative_tokens=2: .*2 prompt tokens ahead",
    ):
        _connector(mtp)
