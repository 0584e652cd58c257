"""A model's memory geometry: what each layer keeps, and the shapes of it.

:class:`ModelSpec` is all the transfer daemon needs to know about a model:
one :class:`LayerKind` per layer, and the geometry of each kind in use
(MHA/GQA attention, sliding-window attention, MLA, one linear-attention
family, replicated side states). It is built from a preset or a config table
(:mod:`pd_transfer.layout.presets`); the rank builder turns it into views.

Pure data; imports only the layout data modules and ``pd_transfer.errors``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from pd_transfer.errors import ConfigError
from pd_transfer.layout.pools.attention import AttentionSpec, MlaSpec
from pd_transfer.layout.pools.checks import require_dtype
from pd_transfer.layout.pools.state_specs import (
    GdnSpec,
    KdaSpec,
    LinearSpec,
    Mamba2Spec,
    SideStateSpec,
    StateTensor,
)


class LayerKind(enum.Enum):
    """What one model layer keeps for a request. Values are the config spelling."""

    ATTENTION = "attention"  # full MHA/GQA attention: KV pool
    SLIDING_ATTENTION = "sliding_attention"  # windowed MHA/GQA: SWA pool
    MLA = "mla"  # MLA latent: KV pool, replicated
    MAMBA2 = "mamba2"  # Mamba2 conv + ssm state
    GDN = "gdn"  # gated delta net conv + temporal state
    KDA = "kda"  # Kimi delta attention conv + temporal state
    NONE = "none"  # MLP / MoE only: nothing to transfer


LINEAR_KINDS = (LayerKind.MAMBA2, LayerKind.GDN, LayerKind.KDA)

# the ModelSpec field holding each kind's geometry
SPEC_FIELD_BY_KIND: dict[LayerKind, str] = {
    LayerKind.ATTENTION: "attention",
    LayerKind.SLIDING_ATTENTION: "sliding_attention",
    LayerKind.MLA: "mla",
    LayerKind.MAMBA2: "mamba2",
    LayerKind.GDN: "gdn",
    LayerKind.KDA: "kda",
}


@dataclass(frozen=True)
class ModelSpec:
    """A model's per-layer kinds and the geometry of each kind it uses.

    Every kind that occurs in ``layer_kinds`` needs its geometry field, and
    every geometry field given must be used by some layer. A model has at most
    one full-attention family (attention or MLA) and one linear family.
    """

    name: str
    layer_kinds: tuple[LayerKind, ...]
    kv_dtype: str = "bfloat16"
    attention: AttentionSpec | None = None
    sliding_attention: AttentionSpec | None = None
    mla: MlaSpec | None = None
    mamba2: Mamba2Spec | None = None
    gdn: GdnSpec | None = None
    kda: KdaSpec | None = None
    side_states: tuple[SideStateSpec, ...] = ()
    source: str = ""
    illustrative: bool = False  # numbers are plausible, not checked against a public config

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ConfigError(f"model {self.name!r}: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        require_dtype("model.kv_dtype", self.kv_dtype)
        if not self.layer_kinds:
            return ["has no layers"]
        problems = []
        used = set(self.layer_kinds)
        for kind, field_name in SPEC_FIELD_BY_KIND.items():
            given = getattr(self, field_name) is not None
            if kind in used and not given:
                problems.append(f"layers of kind {kind.value!r} need model.{field_name}")
            if given and kind not in used:
                problems.append(f"model.{field_name} is given but no layer is {kind.value!r}")
        if {LayerKind.ATTENTION, LayerKind.MLA} <= used:
            problems.append("mixes attention and mla full-attention layers")
        if len(used & set(LINEAR_KINDS)) > 1:
            problems.append(
                f"mixes linear-attention families {sorted(k.value for k in used & set(LINEAR_KINDS))}"
            )
        if self.side_states and not used & set(LINEAR_KINDS):
            problems.append("model.side_states need linear-attention layers to ride with")
        sliding = self.sliding_attention
        if sliding is not None and sliding.window_tokens is None:
            problems.append("model.sliding_attention.window_tokens is missing")
        if self.attention is not None and self.attention.window_tokens is not None:
            problems.append("model.attention.window_tokens is set; windowed layers are sliding_attention")
        return problems

    # -- layers ---------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def layer_ids(self, *kinds: LayerKind) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind in kinds)

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return self.layer_ids(*LINEAR_KINDS)

    @property
    def linear(self) -> LinearSpec | None:
        return self.mamba2 or self.gdn or self.kda

    # -- state ----------------------------------------------------------------
    def state_tensors(self, tp_size: int, tp_rank: int) -> tuple[StateTensor, ...]:
        """Every state tensor of one linear layer's slot on one TP rank."""
        if self.linear is None:
            return ()
        tensors = self.linear.state_tensors(tp_size, tp_rank)
        return tensors + tuple(s.state_tensor() for s in self.side_states)

    def swa_pages_per_request(self, page_size: int) -> int:
        """SWA pages one request holds: the window plus one page it straddles.

        window 128, page_size 16: 128 / 16 + 1 = 9 pages.
        """
        if self.sliding_attention is None or self.sliding_attention.window_tokens is None:
            return 0
        return math.ceil(self.sliding_attention.window_tokens / page_size) + 1
