"""vLLM's own scheduler, configured with the pd-transfer connector, the way vLLM's connector unit tests drive it.

Mirrors ``tests/v1/kv_connector/unit/utils.py`` of vLLM (create_vllm_config,
create_scheduler, create_request, create_model_runner_output), with the
connector loaded by ``kv_connector_module_path`` and a local model config.
Imported only by test modules that already skipped without vLLM.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

CONNECTOR = "PdTransferConnector"
MODULE_PATH = "pd_transfer.integrations.vllm"
EOS_TOKEN_ID = 2
BLOCK_SIZE = 16
_ids = itertools.count(1)
init_none_hash(sha256)


def vllm_config(
    model_dir,
    *,
    kv_role: str,
    extra: dict[str, Any] | None = None,
    policy: str = "fail",
    tp_size: int = 1,
    rank: int = 0,
    block_size: int = BLOCK_SIZE,
    parallel: dict[str, Any] | None = None,
    speculative: dict[str, Any] | None = None,
) -> VllmConfig:
    """``parallel``: more ``ParallelConfig`` fields; ``speculative``: a ``SpeculativeConfig``'s."""
    model = ModelConfig(model=str(model_dir), dtype="float16", seed=0, skip_tokenizer_init=True)
    parallel_config = ParallelConfig(tensor_parallel_size=tp_size, rank=rank, **(parallel or {}))
    return VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=256,
            max_model_len=4096,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=False,
        ),
        cache_config=CacheConfig(
            block_size=block_size, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=True
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector=CONNECTOR,
            kv_connector_module_path=MODULE_PATH,
            kv_role=kv_role,
            kv_connector_extra_config=extra or {},
            kv_load_failure_policy=policy,
        ),
        device_config=DeviceConfig("cpu"),
        parallel_config=parallel_config,
        speculative_config=(
            SpeculativeConfig(
                **speculative, target_model_config=model, target_parallel_config=parallel_config
            )
            if speculative
            else None
        ),
    )


def attention_cache_config(
    layer_names: list[str],
    *,
    num_blocks: int,
    num_kv_heads: int = 4,
    head_size: int = 16,
    mla: bool = False,
    tensors: list[KVCacheTensor] | None = None,
    block_size: int = BLOCK_SIZE,
) -> KVCacheConfig:
    spec_type = MLAAttentionSpec if mla else FullAttentionSpec
    spec = spec_type(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=torch.float16
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors or [],
        kv_cache_groups=[KVCacheGroupSpec(layer_names, spec)],
    )


def scheduler(
    config: VllmConfig, num_blocks: int = 1000, kv_cache_config: KVCacheConfig | None = None
) -> Scheduler:
    block_size = config.cache_config.block_size
    kv_cache_config = kv_cache_config or attention_cache_config(
        ["model.layers.0.self_attn.attn"], num_blocks=num_blocks, block_size=block_size
    )
    config.cache_config.num_gpu_blocks = num_blocks
    return _scheduler(config, kv_cache_config, block_size)


def _scheduler(
    config: VllmConfig, kv_cache_config: KVCacheConfig, block_size: int, hash_block_size: int | None = None
) -> Scheduler:
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        hash_block_size=hash_block_size,
    )


def hybrid_scheduler(config: VllmConfig, kv_cache_config: KVCacheConfig, num_blocks: int) -> Scheduler:
    """vLLM's Scheduler as its engine core builds it for a hybrid model: block sizes resolved
    by vLLM, no prefix caching (vLLM caches a hybrid model's prefixes only in "align" mode)."""
    config.cache_config.enable_prefix_caching = False
    config.cache_config.num_gpu_blocks = num_blocks
    return _scheduler(config, kv_cache_config, *resolve_kv_cache_block_sizes(kv_cache_config, config))


def step(sched: Scheduler, reqs: list[Request], **report: Any) -> tuple[Any, list[Any]]:
    """One scheduler step and the model runner's answer: the schedule and the requests' outputs."""
    out = sched.schedule()
    outputs = sched.update_from_output(out, runner_output(reqs, **report))
    return out, [o for outs in outputs.values() for o in outs.outputs]


def request(
    num_tokens: int,
    *,
    kv_transfer_params: dict | None,
    max_tokens: int = 16,
    block_size: int = BLOCK_SIZE,
    prompt: list[int] | None = None,
) -> Request:
    """A request of ``num_tokens`` tokens (``prompt``: these tokens; else a pattern of its own)."""
    n = next(_ids)
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    req = Request(
        request_id=f"req-{n}",
        prompt_token_ids=list(prompt)
        if prompt is not None
        else [3 + (i * n) % 200 for i in range(num_tokens)],
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )
    req.kv_transfer_params = kv_transfer_params
    return req


def runner_output(
    reqs: list[Request],
    *,
    finished_sending=None,
    finished_recving=None,
    invalid_block_ids=None,
    token_id: int = 7,
    partial: set[str] = frozenset(),
) -> ModelRunnerOutput:
    """One model-runner step: a token for each of ``reqs`` (none for a ``partial`` prefill chunk)
    and the connector's report."""
    ids = [r.request_id for r in reqs]
    report = None
    if finished_sending is not None or finished_recving is not None or invalid_block_ids is not None:
        report = KVConnectorOutput(
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            invalid_block_ids=invalid_block_ids or set(),
        )
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[] if r in partial else [token_id] for r in ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=report,
    )


def num_free_blocks(sched: Scheduler) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


def block_ids(sched: Scheduler, req_id: str) -> list[int]:
    return list(sched.kv_cache_manager.get_block_ids(req_id)[0])
