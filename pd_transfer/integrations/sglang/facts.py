"""What SGLang's ``kv_args`` lack, from its model config and server args.

:class:`EngineFacts` is read once per worker (:mod:`.plugin`) and handed to the
view builders (:mod:`.registration`, :mod:`.kv_entries`, :mod:`.kv_views`);
:class:`ConvGroups` is a conv state's channel split, one of those facts.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_transfer.layout.views import ShardSpec, canonical_range


@dataclass(frozen=True)
class ConvGroups:
    """A conv state's channel groups as the model has them, and which every rank holds whole.

    A Mamba2 conv state is ``[x (d_inner) | B (n_groups*state) | C
    (n_groups*state)]``, each group split over attention TP on its own. With
    fewer B/C groups than ranks (``n_groups = 1``), SGLang's ``MambaMixer2``
    gives every rank the whole group (``mamba_v2_sharded_weight_loader`` with
    ``duplicate_groups``): ``replicated`` names those groups by position, and
    their range is ``[0, group)`` on every rank instead of a slice.
    """

    groups: tuple[int, ...]
    replicated: frozenset[int] = frozenset()

    def shard(self, tp_size: int, tp_rank: int) -> ShardSpec:
        """The groups and this rank's range of each."""
        ranges = tuple(
            (0, g) if i in self.replicated else canonical_range(g, tp_size, tp_rank)
            for i, g in enumerate(self.groups)
        )
        return ShardSpec.grouped(self.groups, ranges)


@dataclass(frozen=True)
class EngineFacts:
    """What ``kv_args`` lacks, from SGLang's model config and server args.

    ``mamba2_conv_groups`` is a Mamba2 conv state's channel split (see
    :class:`ConvGroups`): SGLang leaves it undeclared for Mamba2 models
    (NemotronH, FalconH1, Granite hybrids), whose conv channels are
    nonetheless three independently sharded groups.
    """

    attn_tp_size: int
    pp_size: int = 1
    start_layer: int = 0
    total_kv_heads: int | None = None  # None for MLA
    draft_total_kv_heads: int | None = None  # the speculative draft model's (None: no draft, or MLA)
    dp_rank: int = 0  # the DP group (system DP replica, or attention-DP group) this rank serves
    mamba2_conv_groups: ConvGroups | None = None
    model: str = ""
