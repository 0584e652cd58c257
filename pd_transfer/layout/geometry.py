"""A rank's registration: its regions and tensor views, TP/PP position, page size.

:class:`RankGeometry` is what one worker registers with its sidecar and what
the sidecar sends to peers. :func:`check_geometry` validates one registration
on its own (every view inside a known region, no duplicate tensors, shard
ranges consistent with the rank's TP position) before anything is reconciled;
:func:`registration_problems` returns the same problems as records.

Pure data; no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pd_transfer.errors import GeometryError, Reason
from pd_transfer.layout.views import Pool, TensorView, canonical_range


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class Region:
    """A registered memory region (shared-memory segment, CUDA IPC handle, ...)."""

    id: str
    nbytes: int


@dataclass(frozen=True)
class RankGeometry:
    role: Role
    tp_size: int
    tp_rank: int
    page_size: int
    views: tuple[TensorView, ...]
    regions: tuple[Region, ...]
    pp_rank: int = 0
    model: str = ""
    _by_key: dict = field(default=None, init=False, repr=False, compare=False)

    @property
    def rank_id(self) -> str:
        return f"{self.role.value}[pp{self.pp_rank},tp{self.tp_rank}]"

    def view(self, key: tuple) -> TensorView | None:
        if self._by_key is None:
            object.__setattr__(self, "_by_key", {v.key: v for v in self.views})
        return self._by_key.get(key)

    def region(self, region_id: str) -> Region | None:
        for region in self.regions:
            if region.id == region_id:
                return region
        return None

    def layer_ids(self, pool: Pool) -> set[int]:
        return {v.layer_id for v in self.views if v.pool is pool and v.layer_id is not None}

    def pools(self) -> set[Pool]:
        return {v.pool for v in self.views}


@dataclass(frozen=True)
class RegistrationProblem:
    """One problem of one registration: a view's path (or "" for the whole rank) and what."""

    code: Reason
    subject: str
    detail: str

    def render(self) -> str:
        return f"{self.subject}: {self.detail}" if self.subject else self.detail


def check_geometry(geometry: RankGeometry) -> None:
    """Raise :class:`GeometryError` listing every problem of one registration."""
    problems = registration_problems(geometry)
    if problems:
        lines = [f"invalid registration of {geometry.rank_id}: {len(problems)} problem(s)"]
        lines += [f"  - {p.render()}  [{p.code.value}]" for p in problems]
        raise GeometryError("\n".join(lines), code=problems[0].code)


def registration_problems(geometry: RankGeometry) -> list[RegistrationProblem]:
    """Every problem of one registration, in registration order (empty if valid)."""
    problems: list[RegistrationProblem] = []
    if not 0 <= geometry.tp_rank < geometry.tp_size:
        problems.append(RegistrationProblem(
            Reason.SHARD_RANGE_INVALID, "",
            f"tp_rank {geometry.tp_rank} outside tp_size {geometry.tp_size}"))
    if geometry.page_size <= 0:
        problems.append(RegistrationProblem(Reason.BAD_VIEW, "",
                                            f"page_size {geometry.page_size} must be positive"))
    regions = {r.id: r for r in geometry.regions}
    if len(regions) != len(geometry.regions):
        problems.append(RegistrationProblem(Reason.BAD_VIEW, "", "region ids repeat"))
    seen: set[tuple] = set()
    for view in geometry.views:
        if view.key in seen:
            problems.append(RegistrationProblem(Reason.TENSOR_DUPLICATE, view.path,
                                                "registered twice"))
        seen.add(view.key)
        region = regions.get(view.region)
        if region is None:
            problems.append(RegistrationProblem(Reason.UNKNOWN_REGION, view.path,
                                                f"names unknown region {view.region!r}"))
        else:
            first, last = view.span_nbytes()
            if last > region.nbytes:
                problems.append(RegistrationProblem(
                    Reason.VIEW_OUT_OF_REGION, view.path,
                    f"reaches byte {last} of region {region.id!r} which holds {region.nbytes}"))
        problems += _shard_problems(view, geometry)
    return problems


def _shard_problems(view: TensorView, geometry: RankGeometry) -> list[RegistrationProblem]:
    """A sharded view must hold the canonical range of its rank, per group."""
    if view.shard is None:
        return []
    tp_size, tp_rank = geometry.tp_size, geometry.tp_rank
    problems = []
    for group, got in zip(view.shard.groups, view.shard.ranges):
        if got == (0, group):
            continue  # replicated on every rank
        try:
            want = canonical_range(group, tp_size, tp_rank)
        except GeometryError:
            problems.append(RegistrationProblem(
                Reason.SHARD_NOT_DIVISIBLE, view.path,
                f"sharded axis group of {group} does not split over attn_tp {tp_size}"))
            continue
        if got != want:
            problems.append(RegistrationProblem(
                Reason.SHARD_RANGE_INVALID, view.path,
                f"holds [{got[0]},{got[1]}) of {group} but tp_rank {tp_rank}/{tp_size} "
                f"should hold [{want[0]},{want[1]})"))
    return problems
