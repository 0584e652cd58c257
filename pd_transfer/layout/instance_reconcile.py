"""The verdict on a pair of instances: the one function ``check`` and the sidecars call.

:func:`reconcile_instances` reconciles every rank of a prefill instance with
every rank of a decode instance. Either side may be pipelined, with any
split: each stage registers only its layers, and coverage is a property of
the instance, not of one rank. Every layer id a prefill stage registers must
be registered by a decode stage (and the other way round), and by exactly
one stage on each side: a layer two stages register is a ``tensor_duplicate``
naming the layers and the stages. A linear-attention layer's state moves with
its layer, so it lives on the stage that owns the layer, and a stage may hold
no layer of a pool (every state layer on the last stage): it takes no part in
that pool, on either side. Where the two sides' SWA pages differ in size, a
stage holding sliding-window layers must hold a kv layer too
(:func:`unplaceable_windows`).

Aux rows carry no layer id: every rank that registers them receives them (one
elected writer per decode rank, like any replicated tensor), so each decode
stage whose worker reads the request's metadata registers the rows and gets
its own copy; an instance where no decode rank registers them while prefill
does is rejected like a missing layer.

``pd-transfer check`` calls it with both instances built from worker
configs; a prefill sidecar calls it with its rank table and, for the decode
side, :func:`stage_representatives`: the registering rank and one registered
rank of every other stage (:mod:`pd_transfer.agent.prefill.decode_instances` waits
until each stage has one). The TP ranks of one stage register the same
tensors (each rank's shard ranges are reconciled when it registers), so
layer coverage and every per-tensor verdict are the instance's: the same
verdict, with the same mismatch lines. Pure; no I/O.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from pd_transfer.errors import Mismatch, Reason
from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.layout.reconcile import Reconciliation, reconcile
from pd_transfer.layout.views import AxisRole, Pool


def reconcile_instances(prefill: list[RankGeometry], decode: list[RankGeometry]) -> Reconciliation:
    """Whole prefill instance against whole decode instance; see the module docstring."""
    recon = reconcile(list(prefill), list(decode))
    overlaps = stage_overlaps(prefill, "prefill") + stage_overlaps(decode, "decode")
    overlaps += unplaceable_windows(prefill, decode)
    if not overlaps:
        return recon
    return dataclasses.replace(recon, verdicts=(), mismatches=recon.mismatches + tuple(overlaps))


def stage_overlaps(ranks: list[RankGeometry], side: str) -> list[Mismatch]:
    """One mismatch per layered tensor that more than one PP stage of ``ranks`` registers."""
    stages: dict[tuple, set[int]] = defaultdict(set)
    paths: dict[tuple, str] = {}
    for geometry in ranks:
        for view in geometry.views:
            if view.layer_id is not None:
                stages[view.key].add(geometry.pp_rank)
                paths[view.key] = view.path
    found = []
    for key, pp_ranks in stages.items():
        if len(pp_ranks) < 2:
            continue
        text = "registered by stages " + ", ".join(f"pp{p}" for p in sorted(pp_ranks))
        found.append(
            Mismatch(
                paths[key],
                Reason.TENSOR_DUPLICATE,
                text if side == "prefill" else "-",
                text if side == "decode" else "-",
                f"with pipeline parallelism every layer id must be registered "
                f"by exactly one stage of the {side} instance",
            )
        )
    return found


def unplaceable_windows(prefill: list[RankGeometry], decode: list[RankGeometry]) -> list[Mismatch]:
    """A mismatch per side with a stage that holds sliding-window layers but no kv layer,
    where the two sides' SWA pages differ in size.

    With equal page sizes window pages pair one to one. With different ones they
    are placed by the request's kv pages (the window ends with each side's last
    kv page, :mod:`pd_transfer.agent.prefill.chunks`), which such a stage does
    not name: prefill 64, decode 16, a request of one prefill page ends in any
    of decode pages 0 to 3.
    """
    sizes = [_token_extents(ranks, Pool.SWA) for ranks in (prefill, decode)]
    if not all(sizes) or sizes[0] == sizes[1]:
        return []
    found = []
    for side, ranks in (("prefill", prefill), ("decode", decode)):
        stages = sorted({g.pp_rank for g in ranks if Pool.SWA in g.pools() and Pool.KV not in g.pools()})
        if not stages:
            continue
        named = ", ".join(f"pp{p}" for p in stages)
        text = f"stages {named} hold sliding-window layers but no kv layer"
        pages = [f"pages of {'/'.join(map(str, sorted(e)))} tokens" for e in sizes]
        found.append(
            Mismatch(
                "swa.window_pages",
                Reason.PAGE_SIZE_MISMATCH,
                f"{text}; {pages[0]}" if side == "prefill" else pages[0],
                f"{text}; {pages[1]}" if side == "decode" else pages[1],
                "window pages of different sizes are placed by the request's kv pages: give "
                "both sides one page size, or split the layers so that every stage holding "
                "sliding-window layers holds a full-attention layer too",
            )
        )
    return found


def _token_extents(ranks: list[RankGeometry], pool: Pool) -> set[int]:
    return {
        extent
        for g in ranks
        for v in g.views
        if v.pool is pool and (extent := v.extent(AxisRole.TOKEN)) is not None
    }


def stage_representatives(ranks: list[RankGeometry], own: RankGeometry) -> list[RankGeometry]:
    """``own`` and, for every other PP stage in ``ranks``, its first rank; stage major."""
    chosen = {own.pp_rank: own}
    for geometry in sorted(ranks, key=lambda g: (g.pp_rank, g.tp_rank)):
        chosen.setdefault(geometry.pp_rank, geometry)
    return [chosen[pp] for pp in sorted(chosen)]
