"""The verdict on a pair of instances: the one function ``check`` and the sidecars call.

:func:`reconcile_instances` reconciles every rank of a prefill instance with
every rank of a decode instance. Either side may be pipelined, with any
split: each stage registers only its layers, and coverage is a property of
the instance, not of one rank. Every layer id a prefill stage registers must
be registered by a decode stage (and the other way round), and by exactly
one stage on each side: a layer two stages register is a ``tensor_duplicate``
naming the layers and the stages. A linear-attention layer's state moves with
its layer, so it lives on the stage that owns the layer.

Aux rows carry no layer id: every rank that registers them receives them (one
elected writer per decode rank, like any replicated tensor), so each decode
stage whose worker reads the request's metadata registers the rows and gets
its own copy; an instance where no decode rank registers them while prefill
does is rejected like a missing layer.

``pd-transfer check`` calls it with both instances built from worker
configs; a prefill sidecar calls it with its rank table and, for the decode
side, :func:`stage_representatives`: the registering rank and one registered
rank of every other stage (:mod:`pd_transfer.agent.prefill.instances` waits
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


def reconcile_instances(prefill: list[RankGeometry], decode: list[RankGeometry]) -> Reconciliation:
    """Whole prefill instance against whole decode instance; see the module docstring."""
    recon = reconcile(list(prefill), list(decode))
    overlaps = stage_overlaps(prefill, "prefill") + stage_overlaps(decode, "decode")
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


def stage_representatives(ranks: list[RankGeometry], own: RankGeometry) -> list[RankGeometry]:
    """``own`` and, for every other PP stage in ``ranks``, its first rank; stage major."""
    chosen = {own.pp_rank: own}
    for geometry in sorted(ranks, key=lambda g: (g.pp_rank, g.tp_rank)):
        chosen.setdefault(geometry.pp_rank, geometry)
    return [chosen[pp] for pp in sorted(chosen)]
