"""The KV entries of SGLang's ``kv_args`` as views: the target model's, then the
speculative draft model's (``num_draft_entries`` appended after them).

Each entry's pointer is located in the shared pools (:mod:`.memory`) and
described by :func:`~.kv_views.kv_view`; an entry pointing anywhere else is a
:class:`~pd_transfer.errors.GeometryError` naming it. Used by
:mod:`.registration`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pd_transfer.errors import GeometryError, Reason
from pd_transfer.integrations.sglang.kv_views import kv_view
from pd_transfer.integrations.sglang.memory import EngineMemory
from pd_transfer.layout.views import Pool, TensorView

if TYPE_CHECKING:
    from pd_transfer.integrations.sglang.facts import EngineFacts


def target_kv_views(
    kv_args: Any, memory: EngineMemory, facts: EngineFacts, page_size: int, tp_rank: int
) -> list[TensorView]:
    num_entries = len(kv_args.kv_data_ptrs) - int(getattr(kv_args, "num_draft_entries", 0) or 0)
    layer_ids = list(kv_args.kv_layer_ids or [])
    views = []
    for i in range(num_entries):
        what = f"kv_args.kv_data_ptrs[{i}]"
        entry, offset = memory.locate(kv_args.kv_data_ptrs[i], kv_args.kv_data_lens[i], what)
        if entry.kind not in ("k", "v", "kv"):
            raise GeometryError(f"{what} points into {entry.region}, not a KV buffer", code=Reason.BAD_VIEW)
        layer_id = (
            layer_ids[i]
            if layer_ids
            else entry.layer_id
            if entry.layer_id is not None
            else facts.start_layer + entry.index
        )
        views.append(
            kv_view(
                entry,
                offset,
                layer_id,
                Pool.KV,
                page_size,
                tp_rank,
                facts,
                kv_args.kv_item_lens[i],
                getattr(kv_args, "kv_head_num", None),
            )
        )
    return views


def draft_kv_views(
    kv_args: Any, memory: EngineMemory, facts: EngineFacts, page_size: int, tp_rank: int
) -> list[TensorView]:
    """The speculative draft model's KV: ``kv_args``' last ``num_draft_entries`` entries.

    SGLang appends the draft pool's buffers (``[draft K.., draft V..]``, or
    the MTP latent) after the target's; they are addressed by the target's
    page indices. Each becomes a KV view named ``draft_k``/``draft_v``/
    ``draft_latent`` at its position in the draft pool, so a pair whose two
    sides disagree on the draft (one runs none) is refused by name, never
    sent without it. The draft's KV heads are the draft model's, split over
    the same attention TP.
    """
    num_draft = int(getattr(kv_args, "num_draft_entries", 0) or 0)
    num_target = len(kv_args.kv_data_ptrs) - num_draft
    draft_facts = replace(facts, total_kv_heads=facts.draft_total_kv_heads)
    views = []
    for i in range(num_target, num_target + num_draft):
        what = f"kv_args.kv_data_ptrs[{i}]"
        entry, offset = memory.locate(kv_args.kv_data_ptrs[i], kv_args.kv_data_lens[i], what)
        if entry.kind not in ("draft_k", "draft_v", "draft_kv"):
            raise GeometryError(
                f"{what}: one of kv_args' {num_draft} draft entries points into {entry.region}, "
                f"not the draft model's KV pool",
                code=Reason.BAD_VIEW,
                hint="pass SGLang's draft_token_to_kv_pool to share_engine_memory",
            )
        if entry.kind != "draft_kv" and facts.draft_total_kv_heads is None:
            raise GeometryError(
                f"kv.layer[{entry.index}].draft_{entry.kind.removeprefix('draft_')}: the draft "
                f"model's total KV head count is not known",
                code=Reason.BAD_VIEW,
                hint="pass draft_total_kv_heads from the draft model's config",
            )
        views.append(
            kv_view(
                entry,
                offset,
                entry.index,
                Pool.KV,
                page_size,
                tp_rank,
                draft_facts,
                kv_args.kv_item_lens[i],
                None,
            )
        )
    return views
