"""SGLang plugin: ``--disaggregation-transfer-backend pd_transfer``.

Registered under SGLang's ``sglang.srt.plugins`` entry-point group
(``pip install 'pd-transfer[sglang]'``); SGLang calls :func:`load` in every
process before it starts. It

- adds ``pd_transfer`` to ``TransferBackend`` (:mod:`.backend_enum`) and to
  the ``--disaggregation-transfer-backend`` choices;
- wraps ``get_kv_class`` so that prefill, decode and the disaggregation
  service get pd-transfer's manager, sender, receiver and bootstrap classes;
- wraps both queues' ``_init_kv_manager``: before SGLang fills ``kv_args``,
  the pools are collected (on CPU, moved into shared memory, see
  :mod:`.memory`) and the facts ``kv_args`` lacks are read from SGLang's
  model config and parallel state (:func:`engine_facts`).
"""

from __future__ import annotations

import logging
from typing import Any

from pd_transfer.errors import GeometryError, Reason
from pd_transfer.integrations.sglang.backend_enum import add_backend_member
from pd_transfer.integrations.sglang.dp_routing import dp_group, refuse_unsupported
from pd_transfer.integrations.sglang.facts import ConvGroups, EngineFacts
from pd_transfer.integrations.sglang.settings import force_query_prefill_dp_rank
from pd_transfer.layout.geometry import Role

log = logging.getLogger(__name__)

_QUEUES = (
    "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager",
    "sglang.srt.disaggregation.decode.DecodePreallocQueue._init_kv_manager",
)


def load() -> None:
    """The entry point SGLang's ``load_plugins`` calls."""
    from sglang.srt.arg_groups.choices import add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    add_backend_member(TransferBackend)
    add_disagg_transfer_backend_choices(["pd_transfer"])
    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", _get_kv_class, HookType.AROUND)
    for target in _QUEUES:
        HookRegistry.register(target, _init_kv_manager, HookType.AROUND)


def kv_classes() -> dict[str, type]:
    """pd-transfer's classes by SGLang ``KVClassType`` name."""
    from pd_transfer.integrations.sglang import conn

    return {
        "MANAGER": conn.PdTransferKVManager,
        "SENDER": conn.PdTransferKVSender,
        "RECEIVER": conn.PdTransferKVReceiver,
        "BOOTSTRAP_SERVER": conn.PdTransferKVBootstrapServer,
    }


def _is_ours(backend: Any) -> bool:
    return getattr(backend, "value", backend) == "pd_transfer"


def _get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    if not _is_ours(transfer_backend) or class_type.name == "KVARGS":
        return original(transfer_backend, class_type)
    return kv_classes()[class_type.name]


def _init_kv_manager(original: Any, queue: Any, *args: Any, **kwargs: Any) -> Any:
    if not _is_ours(queue.transfer_backend):
        return original(queue, *args, **kwargs)
    from pd_transfer.integrations.sglang import refusals
    from pd_transfer.integrations.sglang.conn import ENGINE_MEMORY
    from pd_transfer.integrations.sglang.memory import share_engine_memory

    refusals.refuse_unsupported(_disagg(queue), decode=_is_decode(queue))
    scheduler = queue.scheduler
    role = Role.PREFILL if queue.__class__.__name__.startswith("Prefill") else Role.DECODE
    refuse_unsupported(_parallel(), role, force_query_prefill_dp_rank())  # before any memory moves
    mamba_pool = _mamba_pool(queue.token_to_kv_pool, getattr(scheduler, "req_to_token_pool", None))
    draft_pool = getattr(queue, "draft_token_to_kv_pool", None)  # set by SGLang only with a draft model
    memory = share_engine_memory(
        f"sglang-{role.value}-tp{queue.tp_rank}",
        kv_pool=queue.token_to_kv_pool,
        metadata_buffers=queue.metadata_buffers,
        mamba_pool=mamba_pool,
        draft_kv_pool=draft_pool,
    )
    try:  # a start that fails leaves no shared-memory name behind (CPU)
        hf_config = getattr(scheduler.model_config, "hf_config", None)
        facts = engine_facts(
            scheduler.model_config,
            _parallel(),
            queue.token_to_kv_pool,
            getattr(hf_config, "mamba2_cache_params", None),
            is_mla=queue.is_mla_backend,
            draft_model_config=_draft_model_config(scheduler) if _per_head(draft_pool) else None,
        )
        token = ENGINE_MEMORY.set((memory, facts))
        try:
            return original(queue, *args, **kwargs)
        finally:
            ENGINE_MEMORY.reset(token)
    except BaseException:
        memory.close()
        raise


def _parallel() -> Any:
    from sglang.srt.disaggregation.prefill import get_parallel

    return get_parallel()


def _disagg(queue: Any) -> Any:
    """SGLang's resolved disaggregation settings, else the server args they resolve from."""
    from sglang.srt.runtime_context import get_disagg

    try:
        return get_disagg()
    except ValueError:  # not published in this process (a queue built outside a scheduler)
        return queue.scheduler.server_args


def _is_decode(queue: Any) -> bool:
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    return isinstance(queue, DecodePreallocQueue)


def _per_head(draft_pool: Any) -> bool:
    """Whether a draft pool keeps per-head K and V (EAGLE's MHA pool), whose sharding needs
    the draft model's KV heads; an MTP latent pool is replicated."""
    full = getattr(draft_pool, "full_kv_pool", draft_pool)
    return draft_pool is not None and not hasattr(full, "kv_buffer")


def _draft_model_config(scheduler: Any) -> Any:
    """The speculative draft model's config, read as SGLang's scheduler reads it for the PD
    metadata schema (``--speculative-draft-model-path``)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import get_spec

    spec = get_spec()
    return ModelConfig.from_server_args(
        scheduler.server_args,
        model_path=spec.speculative_draft_model_path,
        model_revision=spec.speculative_draft_model_revision,
        is_draft_model=True,
    )


def _mamba_pool(kv_pool: Any, req_to_token_pool: Any) -> Any:
    for holder in (kv_pool, req_to_token_pool):
        pool = getattr(holder, "mamba_pool", None)
        if pool is not None:
            return pool
    return None


def engine_facts(
    model_config: Any,
    parallel: Any,
    kv_pool: Any,
    cache_params: Any = None,
    *,
    is_mla: bool = False,
    draft_model_config: Any = None,
) -> EngineFacts:
    """What ``kv_args`` lacks, from SGLang's model config, parallel state and pool
    (and the speculative draft model's config, where there is a draft)."""
    attn_tp_size = int(parallel.attn_tp_size)
    hf_config = getattr(model_config, "hf_config", None)
    return EngineFacts(
        attn_tp_size=attn_tp_size,
        pp_size=int(getattr(parallel, "pp_size", 1)),
        start_layer=int(getattr(kv_pool, "start_layer", 0) or 0),
        total_kv_heads=None if is_mla else int(model_config.get_total_num_kv_heads()),
        draft_total_kv_heads=None
        if draft_model_config is None
        else int(draft_model_config.get_total_num_kv_heads()),
        dp_rank=dp_group(parallel)[0],
        mamba2_conv_groups=mamba2_conv_groups(cache_params, attn_tp_size, model_n_groups(hf_config)),
        model=str(getattr(model_config, "model_path", "") or ""),
    )


_N_GROUPS_FIELDS = ("n_groups", "mamba_n_groups")  # Mamba2/NemotronH; FalconH1, Granite hybrids


def model_n_groups(hf_config: Any) -> tuple[int, ...]:
    """The B/C group counts a Mamba2 model's config names (the fields SGLang's configs read)."""
    values = (getattr(hf_config, name, None) for name in _N_GROUPS_FIELDS)
    return tuple(int(v) for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0)


def mamba2_conv_groups(cache_params: Any, tp_size: int, n_groups: tuple[int, ...] = ()) -> ConvGroups | None:
    """A Mamba2 conv state's groups ``(d_inner, n_groups*state, n_groups*state)`` and their sharding.

    SGLang declares conv groups for GDN (``conv_shard_groups``) but leaves
    them out for Mamba2 models, whose conv channels are
    ``[x (d_inner) | B (n_groups*state) | C (n_groups*state)]``, each sharded on
    its own: slicing them as one contiguous range across different TP sizes
    moves B's channels into x's place. ``cache_params.shape.conv_dim`` is
    TP-extended: with fewer groups than ranks SGLang counts ``tp_size`` groups
    (``extra_groups_for_head_shards``) and its ``MambaMixer2`` gives every rank
    the one group whole, so B and C are replicated, not sliced. ``n_groups``
    (from the model config, see :func:`model_n_groups`) tells that apart from
    a model with ``tp_size`` groups.
    """
    shape = getattr(cache_params, "shape", None)  # SGLang's Mamba2CacheParams, from its model config
    if shape is None or getattr(shape, "conv_shard_groups", None) is not None:
        return None
    if getattr(shape, "conv_slice_axis", 0) != 0 or not hasattr(shape, "intermediate_size"):
        return None
    inner, state = int(shape.intermediate_size), int(shape.state_size)
    bc = (int(shape.conv_dim) - inner) // 2
    if bc <= 0 or inner + 2 * bc != int(shape.conv_dim) or bc % state:
        return None
    groups = _model_groups(bc // state, tp_size, n_groups)
    replicated = frozenset({1, 2}) if groups % tp_size else frozenset()
    return ConvGroups((inner, groups * state, groups * state), replicated)


def _model_groups(held: int, tp_size: int, named: tuple[int, ...]) -> int:
    """The model's B/C group count, from the ``held`` groups SGLang's TP-extended conv_dim counts."""
    extended = {g: g if g % tp_size == 0 else g + tp_size - g for g in named}  # extra_groups_for_head_shards
    fitting = [g for g in named if extended[g] == held]
    if fitting:
        groups = fitting[0]
    elif named:
        raise GeometryError(
            f"mamba2 conv state: the model config's n_groups {list(named)} over attn_tp_size {tp_size} "
            f"give {[extended[g] for g in named]} B/C groups, SGLang's conv_dim holds {held}",
            code=Reason.BAD_VIEW,
        )
    elif held % tp_size or (held == tp_size and tp_size > 1):
        raise GeometryError(
            f"mamba2 conv state: {held} B/C groups over attn_tp_size {tp_size} are either the "
            f"model's n_groups or fewer groups replicated on every rank, and the model config "
            f"names no n_groups ({' or '.join(_N_GROUPS_FIELDS)})",
            code=Reason.LAYOUT_UNSUPPORTED,
            hint="set n_groups in the model's config.json",
        )
    else:
        groups = held
    if groups % tp_size and groups != 1:
        raise GeometryError(
            f"mamba2 conv state: n_groups={groups} over attn_tp_size {tp_size}: SGLang's MambaMixer2 "
            f"replicates B and C across ranks only for n_groups=1 (it asserts n_groups % tp_size "
            f"== 0 or n_groups == 1), so no rank layout of these groups exists",
            code=Reason.LAYOUT_UNSUPPORTED,
            hint=f"run an attention TP size that divides n_groups={groups}",
        )
    return groups
