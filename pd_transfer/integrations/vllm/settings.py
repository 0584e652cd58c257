"""The vLLM settings the connector supports, and a refusal naming each one it does not.

Checked when vLLM builds the connector (scheduler and workers alike), so an
instance configured for something pd-transfer cannot do fails at start,
naming the setting, its value and the reason, instead of sending KV that
decode would read wrong:

- ``kv_transfer_config.kv_role``: ``kv_producer`` (prefill) or
  ``kv_consumer`` (decode). ``kv_both`` is refused: an instance that both
  sends and loads needs to know per request which it does, and the router
  convention here gives each instance one role.
- ``parallel_config.pipeline_parallel_size`` > 1: refused; the connector
  registers one rank per TP rank and has no pipeline stage in its sidecar
  endpoint or registration.
- ``parallel_config.decode_context_parallel_size`` or
  ``prefill_context_parallel_size`` > 1: refused; the KV of one request is
  then split across ranks by token, which the connector does not describe.
- ``parallel_config.data_parallel_size`` > 1: supported when
  ``worker_endpoint`` (and, on prefill, ``bootstrap_addr``) contain
  ``{dp_rank}``: each data-parallel engine is an instance of its own with
  its own sidecars (a decode engine loads from whichever prefill engine's
  bootstrap address the router forwards). Without the placeholder the
  engines would share one sidecar per TP rank: refused.
- ``speculative_config``: EAGLE-style drafters are supported (their draft
  layers' KV is registered and moved like any other layer; both instances
  need the same draft layers, which the sidecars check when they pair).
  A multi-module MTP drafter (more than one token of prefill lookahead) is
  refused: vLLM keeps its lookahead window off the prefill instance, which
  this connector does not do.

Works on duck-typed vLLM config objects; no vLLM import.
"""

from __future__ import annotations

from typing import Any

from pd_transfer.errors import ConfigError

DP_PLACEHOLDER = "{dp_rank}"


def refuse_unsupported(vllm_config: Any, extra: dict[str, Any], *, prefill: bool) -> None:
    """Raise :class:`ConfigError` listing every unsupported setting of ``vllm_config`` (see above)."""
    parallel = vllm_config.parallel_config
    refused = []
    for name, why in (
        ("pipeline_parallel_size", "the connector registers one rank per TP rank, not per pipeline stage"),
        ("decode_context_parallel_size", "a request's KV would be split across ranks by token"),
        ("prefill_context_parallel_size", "a request's KV would be split across ranks by token"),
    ):
        size = getattr(parallel, name)
        if size != 1:
            refused.append(f"parallel_config.{name}={size}: {why}")
    refused += _data_parallel(parallel, extra, prefill=prefill)
    lookahead = _prefill_lookahead(vllm_config)
    if lookahead > 1:
        spec = vllm_config.speculative_config
        refused.append(
            f"speculative_config.method={spec.method!r} with num_speculative_tokens="
            f"{spec.num_speculative_tokens}: a multi-module MTP drafter reads {lookahead} "
            f"prompt tokens ahead, which would have to stay off the prefill instance"
        )
    if refused:
        raise ConfigError(
            "the pd-transfer vLLM connector does not support this instance's settings: " + "; ".join(refused)
        )


def fill_placeholders(template: str, *, tp_rank: int, dp_rank: int) -> str:
    """``template`` with ``{tp_rank}`` and ``{dp_rank}`` filled in."""
    return template.replace("{tp_rank}", str(tp_rank)).replace(DP_PLACEHOLDER, str(dp_rank))


def dp_rank(vllm_config: Any) -> int:
    return vllm_config.parallel_config.data_parallel_rank


def tp_position(vllm_config: Any) -> tuple[int, int]:
    """(tp_size, tp_rank) of this worker process."""
    from vllm.distributed import parallel_state

    tp_size = vllm_config.parallel_config.tensor_parallel_size
    if parallel_state.model_parallel_is_initialized():
        return tp_size, parallel_state.get_tensor_model_parallel_rank()
    return tp_size, vllm_config.parallel_config.rank % tp_size


def _data_parallel(parallel: Any, extra: dict[str, Any], *, prefill: bool) -> list[str]:
    size = parallel.data_parallel_size
    if size == 1:
        return []
    keys = ["worker_endpoint"] + (["bootstrap_addr"] if prefill else [])
    missing = [key for key in keys if DP_PLACEHOLDER not in str(extra.get(key, ""))]
    if not missing:
        return []
    return [
        f"parallel_config.data_parallel_size={size} with kv_connector_extra_config."
        f"{' and '.join(missing)} lacking '{DP_PLACEHOLDER}': the data-parallel engines would "
        f"share one sidecar (and bootstrap address); put '{DP_PLACEHOLDER}' in them"
    ]


def _prefill_lookahead(vllm_config: Any) -> int:
    """vLLM's ``num_prefill_lookahead_tokens`` (0 without a drafter)."""
    return 0 if vllm_config.speculative_config is None else vllm_config.num_prefill_lookahead_tokens
