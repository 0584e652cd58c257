"""A rank's registration: its regions and tensor views, TP/PP position, page size.

:class:`RankGeometry` is what one worker registers with its sidecar and what
the sidecar sends to peers. :func:`check_geometry` validates one registration
on its own (every view inside a known region, no duplicate tensors, shard
ranges consistent with the rank's TP position, regions of sane sizes and, when
the segment handles are given, no two regions over the same segment) before
anything is reconciled; :func:`registration_problems` returns the same
problems as records. A registration comes from another process (the worker)
or another host (a peer's Register): every limit here is a refusal with a
reason code and the field at fault, never an ``assert``.

Pure data; no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from pd_transfer.errors import GeometryError, Reason
from pd_transfer.layout.views import Pool, TensorView, canonical_range

# A worker registers at most a few TiB; 2**46 (64 TiB) leaves room for every host
# pool we know of and refuses sizes that only a corrupt or hostile frame carries.
MAX_REGION_NBYTES = 2**46
MAX_VIEWS = 100_000  # DeepSeek-V3 registers 64 views per rank


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
    _by_key: dict[tuple[object, ...], TensorView] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @property
    def rank_id(self) -> str:
        return f"{self.role.value}[pp{self.pp_rank},tp{self.tp_rank}]"

    def view(self, key: tuple) -> TensorView | None:
        by_key = self._by_key
        if by_key is None:
            by_key = {v.key: v for v in self.views}
            object.__setattr__(self, "_by_key", by_key)
        return by_key.get(key)

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


def check_geometry(geometry: RankGeometry, handles: Mapping[str, str] | None = None) -> None:
    """Raise :class:`GeometryError` listing every problem of one registration.

    ``handles`` (region id -> segment name or CUDA IPC handle), when given,
    is checked against the regions too: see :func:`handle_problems`.
    """
    problems = registration_problems(geometry)
    if handles is not None:
        problems += handle_problems(geometry, handles)
    if problems:
        lines = [f"invalid registration of {geometry.rank_id}: {len(problems)} problem(s)"]
        lines += [f"  - {p.render()}  [{p.code.value}]" for p in problems]
        raise GeometryError("\n".join(lines), code=problems[0].code)


def registration_problems(geometry: RankGeometry) -> list[RegistrationProblem]:
    """Every problem of one registration, in registration order (empty if valid)."""
    problems: list[RegistrationProblem] = []
    if not 0 <= geometry.tp_rank < geometry.tp_size:
        problems.append(
            RegistrationProblem(
                Reason.SHARD_RANGE_INVALID,
                "",
                f"tp_rank {geometry.tp_rank} outside tp_size {geometry.tp_size}",
            )
        )
    if geometry.page_size <= 0:
        problems.append(
            RegistrationProblem(Reason.BAD_VIEW, "", f"page_size {geometry.page_size} must be positive")
        )
    problems += _region_problems(geometry)
    if len(geometry.views) > MAX_VIEWS:
        # checking each of millions of views would be the attack; refuse the count alone
        problems.append(
            RegistrationProblem(
                Reason.LIMIT_EXCEEDED,
                "views",
                f"{len(geometry.views)} views registered, at most {MAX_VIEWS} are accepted",
            )
        )
        return problems
    regions = {r.id: r for r in geometry.regions}
    seen: set[tuple] = set()
    for view in geometry.views:
        if view.key in seen:
            problems.append(RegistrationProblem(Reason.TENSOR_DUPLICATE, view.path, "registered twice"))
        seen.add(view.key)
        region = regions.get(view.region)
        if region is None:
            problems.append(
                RegistrationProblem(Reason.UNKNOWN_REGION, view.path, f"names unknown region {view.region!r}")
            )
        else:
            first, last = view.span_nbytes()
            if last > region.nbytes:
                problems.append(
                    RegistrationProblem(
                        Reason.VIEW_OUT_OF_REGION,
                        view.path,
                        f"reaches byte {last} of region {region.id!r} which holds {region.nbytes}",
                    )
                )
        problems += _shard_problems(view, geometry)
    return problems


def _region_problems(geometry: RankGeometry) -> list[RegistrationProblem]:
    """Each region once, with a size in [1, MAX_REGION_NBYTES]."""
    problems: list[RegistrationProblem] = []
    first_index: dict[str, int] = {}
    for i, region in enumerate(geometry.regions):
        if region.id in first_index:
            problems.append(
                RegistrationProblem(
                    Reason.BAD_VIEW,
                    f"regions[{i}].id",
                    f"region ids repeat: {region.id!r} is also regions[{first_index[region.id]}]",
                )
            )
        first_index.setdefault(region.id, i)
        if isinstance(region.nbytes, bool) or not isinstance(region.nbytes, int) or region.nbytes <= 0:
            problems.append(
                RegistrationProblem(
                    Reason.REGION_INVALID,
                    f"regions[{i}].nbytes",
                    f"region {region.id!r} holds {region.nbytes!r} bytes; a region holds at least 1",
                )
            )
        elif region.nbytes > MAX_REGION_NBYTES:
            problems.append(
                RegistrationProblem(
                    Reason.LIMIT_EXCEEDED,
                    f"regions[{i}].nbytes",
                    f"region {region.id!r} claims {region.nbytes} bytes, more than the "
                    f"{MAX_REGION_NBYTES} (2**46) any worker registers",
                )
            )
    return problems


def handle_problems(geometry: RankGeometry, handles: Mapping[str, str]) -> list[RegistrationProblem]:
    """Problems of the segment handles of a registration (region id -> handle).

    Every region needs a handle, every handle a region, and no two regions may
    share one: a region is the whole segment from byte 0, so two regions over
    one segment overlap (``kv`` of 8192 bytes and ``aux`` of 4096 bytes on
    segment ``pdt-w0`` share bytes [0, 4096)), and a write into one would land
    in the other.
    """
    problems: list[RegistrationProblem] = []
    regions = {r.id: r for r in geometry.regions}
    for region_id in regions:
        if region_id not in handles:
            problems.append(
                RegistrationProblem(
                    Reason.BAD_FIELD, f"handles[{region_id!r}]", f"no segment handle for region {region_id!r}"
                )
            )
    owner_of: dict[str, str] = {}
    for region_id, handle in handles.items():
        if region_id not in regions:
            problems.append(
                RegistrationProblem(
                    Reason.UNKNOWN_REGION, f"handles[{region_id!r}]", f"names unknown region {region_id!r}"
                )
            )
            continue
        other = owner_of.setdefault(handle, region_id)
        if other != region_id:
            shared = min(regions[other].nbytes, regions[region_id].nbytes)
            problems.append(
                RegistrationProblem(
                    Reason.REGION_INVALID,
                    f"handles[{region_id!r}]",
                    f"regions {other!r} and {region_id!r} both map segment {handle[:80]!r}: their "
                    f"byte ranges overlap in [0, {shared})",
                )
            )
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
            problems.append(
                RegistrationProblem(
                    Reason.SHARD_NOT_DIVISIBLE,
                    view.path,
                    f"sharded axis group of {group} does not split over attn_tp {tp_size}",
                )
            )
            continue
        if got != want:
            problems.append(
                RegistrationProblem(
                    Reason.SHARD_RANGE_INVALID,
                    view.path,
                    f"holds [{got[0]},{got[1]}) of {group} but tp_rank {tp_rank}/{tp_size} "
                    f"should hold [{want[0]},{want[1]})",
                )
            )
    return problems
