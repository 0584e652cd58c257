"""Building a rank's whole registration from a model spec and a worker shape.

:func:`build_rank` lays out every pool a model needs on one worker (TP rank,
PP stage): full-attention KV or MLA pages, sliding-window pages, linear
attention state slots and aux rows, and checks the result with
:func:`check_geometry`. :func:`build_instance` does it for every rank of an
instance. This is what the simulated worker and the offline ``check`` use to
describe a worker without a GPU.

Pipeline parallelism splits the layers into ``pp_size`` contiguous spans, the
first stages taking one extra layer when the count does not divide: 61 layers
over 4 stages are [0,16), [16,31), [31,46), [46,61). An explicit partition
(``pp_layers``, layers per stage, like vLLM's ``VLLM_PP_LAYER_PARTITION``)
splits them unevenly: (10, 40, 11) is [0,10), [10,50), [50,61). A rank
registers only its span's layers and keeps their global ids; a stage may hold
no layer of a pool (all state layers on the last stage), and then registers
none of it.

Pure; imports the layout layer only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pd_transfer.errors import ConfigError, Reason
from pd_transfer.layout.geometry import RankGeometry, Role, check_geometry
from pd_transfer.layout.model_spec import LINEAR_KINDS, LayerKind, ModelSpec
from pd_transfer.layout.pools import (
    KvPoolShape,
    PoolViews,
    build_aux_rows,
    build_kv_pool,
    build_mla_pool,
    build_state_pool,
)
from pd_transfer.layout.pools.checks import require_dtype, require_positive
from pd_transfer.layout.pools.state import STATE_LAYOUTS
from pd_transfer.layout.views import KV_LAYOUTS, Layout, Pool


@dataclass(frozen=True, kw_only=True)
class WorkerShape:
    """How one worker holds its pools: parallel position, sizes and layouts.

    ``num_swa_pages`` None means as many SWA pages as ``num_pages`` (a request
    needs ``ModelSpec.swa_pages_per_request`` of them). ``num_slots`` is
    required when the model has linear-attention layers. ``kv_dtype`` None
    keeps the model's KV dtype; ``state_layout`` None means the device
    ``slot`` layout.
    """

    role: Role
    tp_size: int
    tp_rank: int
    page_size: int
    kv_layout: Layout
    num_pages: int
    pp_size: int = 1
    pp_rank: int = 0
    num_swa_pages: int | None = None
    num_slots: int | None = None
    num_aux_rows: int = 64
    kv_dtype: str | None = None
    state_layout: Layout | None = None
    pp_layers: tuple[int, ...] | None = None  # layers per stage; None: an even split

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            raise ConfigError(f"shape.role must be one of {[r.value for r in Role]}, got {self.role!r}")
        for name in ("tp_size", "pp_size", "page_size", "num_pages", "num_aux_rows"):
            require_positive(f"shape.{name}", getattr(self, name))
        _require_index("shape.tp_rank", self.tp_rank, self.tp_size, "attn_tp_size")
        _require_index("shape.pp_rank", self.pp_rank, self.pp_size, "pp_size")
        for name in ("num_swa_pages", "num_slots"):
            if getattr(self, name) is not None:
                require_positive(f"shape.{name}", getattr(self, name))
        if self.kv_dtype is not None:
            require_dtype("shape.kv_dtype", self.kv_dtype)
        if self.kv_layout not in KV_LAYOUTS:
            raise ConfigError(
                f"shape.kv_layout must be one of {[option.value for option in KV_LAYOUTS]}, "
                f"got {self.kv_layout!r}"
            )
        if self.state_layout is not None and self.state_layout not in STATE_LAYOUTS:
            raise ConfigError(
                f"shape.state_layout must be one of "
                f"{[option.value for option in STATE_LAYOUTS]}, got {self.state_layout!r}"
            )


def _require_index(field_path: str, value: object, size: int, size_name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
        raise ConfigError(
            f"{field_path} must be in [0, {size}) for {size_name} {size}, got {value!r}",
            code=Reason.SHARD_RANGE_INVALID,
        )


def pp_layer_span(
    num_layers: int, pp_size: int, pp_rank: int, pp_layers: tuple[int, ...] | None = None
) -> range:
    """Global layer ids of PP stage ``pp_rank``: ``pp_layers[pp_rank]`` of them after the
    earlier stages' where given, else an even split whose first stages take the remainder."""
    if pp_size > num_layers:
        raise ConfigError(f"pp_size {pp_size} is larger than the model's {num_layers} layers")
    _require_index("pp_rank", pp_rank, pp_size, "pp_size")
    if pp_layers is not None:
        counts = list(pp_layers)
        if (
            len(counts) != pp_size
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts)
            or sum(counts) != num_layers
        ):
            raise ConfigError(
                f"pp_layers {counts} must be {pp_size} positive layer counts (one per stage) "
                f"that add up to the model's {num_layers} layers"
            )
        start = sum(counts[:pp_rank])
        return range(start, start + counts[pp_rank])
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def build_rank(spec: ModelSpec, shape: WorkerShape) -> RankGeometry:
    """Every pool of ``spec`` for the worker ``shape``, checked."""
    span = pp_layer_span(spec.num_layers, shape.pp_size, shape.pp_rank, shape.pp_layers)

    def local(*kinds: LayerKind) -> tuple[int, ...]:
        return tuple(i for i in spec.layer_ids(*kinds) if i in span)

    dtype = shape.kv_dtype or spec.kv_dtype
    grid = KvPoolShape(shape.num_pages, shape.page_size, shape.kv_layout, dtype)
    parts: list[PoolViews] = []
    if spec.attention is not None:
        parts.append(
            build_kv_pool(
                spec.attention, local(LayerKind.ATTENTION), grid, tp_size=shape.tp_size, tp_rank=shape.tp_rank
            )
        )
    if spec.sliding_attention is not None:
        swa_grid = KvPoolShape(
            shape.num_swa_pages or shape.num_pages, shape.page_size, shape.kv_layout, dtype
        )
        parts.append(
            build_kv_pool(
                spec.sliding_attention,
                local(LayerKind.SLIDING_ATTENTION),
                swa_grid,
                pool=Pool.SWA,
                tp_size=shape.tp_size,
                tp_rank=shape.tp_rank,
            )
        )
    if spec.mla is not None:
        parts.append(build_mla_pool(spec.mla, local(LayerKind.MLA), grid))
    if spec.linear is not None:
        parts.append(_state_pool(spec, shape, local(*LINEAR_KINDS)))
    parts.append(build_aux_rows(shape.num_aux_rows))
    merged = PoolViews.merge(parts)
    geometry = RankGeometry(
        role=shape.role,
        tp_size=shape.tp_size,
        tp_rank=shape.tp_rank,
        page_size=shape.page_size,
        views=merged.views,
        regions=merged.regions,
        pp_rank=shape.pp_rank,
        model=spec.name,
    )
    check_geometry(geometry)
    return geometry


def _state_pool(spec: ModelSpec, shape: WorkerShape, layer_ids: tuple[int, ...]) -> PoolViews:
    if shape.num_slots is None:
        raise ConfigError(
            f"shape.num_slots is required: model {spec.name!r} has "
            f"{len(spec.linear_layer_ids)} linear-attention layers, each "
            f"keeping one state slot per request"
        )
    tensors = spec.state_tensors(shape.tp_size, shape.tp_rank)
    return build_state_pool(
        tensors, layer_ids, num_slots=shape.num_slots, layout=shape.state_layout or Layout.SLOT
    )


def build_instance(
    spec: ModelSpec, role: Role, tp_size: int, pp_size: int = 1, **shape_kwargs: Any
) -> list[RankGeometry]:
    """Every rank of an instance, PP stage major: ``[pp0 tp0, pp0 tp1, ..., pp1 tp0, ...]``.

    ``shape_kwargs`` are the other :class:`WorkerShape` fields (page_size,
    kv_layout, num_pages, ...).
    """
    return [
        build_rank(
            spec,
            WorkerShape(
                role=role, tp_size=tp_size, tp_rank=tp_rank, pp_size=pp_size, pp_rank=pp_rank, **shape_kwargs
            ),
        )
        for pp_rank in range(pp_size)
        for tp_rank in range(tp_size)
    ]
