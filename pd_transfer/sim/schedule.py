"""The request schedule both sides of the simulation derive on their own.

A router would give a prefill worker and a decode worker a room id and each
would allocate its pages. Here neither side talks to the other: both call
:func:`build_schedule` with the same arguments and get the same list of
:class:`ScheduledRequest`, so the decode worker knows which source pages its
destination pages should hold without being told.

At most ``window`` rooms are in flight: request ``r`` uses window slot
``r % window`` and may start only when request ``r - window`` (same slot) is
finished. Each pool is split into ``window`` disjoint blocks, one per slot, so
two rooms in flight never share a page, state slot or aux row; inside its
block a request takes a random set of pages in random order (engines hand out
fragmented pages; the transfer must place each one positionally).

Worked example: 1000 pages, window 4, 100 pages a request: slot 1 owns a
block of 250 pages (a fixed random subset of the pool) and request 5 takes
100 of them, shuffled.

Pure; numpy only.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from pd_transfer.errors import ConfigError
from pd_transfer.layout.views import Pool

ROOM_STRIDE = 1 << 32  # rooms of seed s are s * 2**32 + r: two seeds never share a room
MAX_SEED = (1 << 30) - 1


@dataclass(frozen=True)
class PoolSizes:
    """One side's pool capacities; 0 where the model has no such pool."""

    num_pages: int
    num_swa_pages: int = 0
    num_slots: int = 0
    num_aux_rows: int = 0


@dataclass(frozen=True)
class ScheduleSpec:
    """Everything both sides must agree on to derive the same schedule.

    ``swa_pages_per_request`` is ``ModelSpec.swa_pages_per_request(page_size)``
    (0 without sliding-window layers); ``uses_state`` is True for models with
    linear-attention layers. ``shuffle`` False hands out pages in order
    (contiguous runs, for measuring the best case).
    """

    seed: int
    num_requests: int
    tokens: int
    page_size: int
    window: int
    prefill: PoolSizes
    decode: PoolSizes
    swa_pages_per_request: int = 0
    uses_state: bool = False
    uses_aux: bool = True
    shuffle: bool = True

    @property
    def pages_per_request(self) -> int:
        return math.ceil(self.tokens / self.page_size)

    @property
    def swa_pages(self) -> int:
        """SWA pages of one request: the window's pages, at most the request's."""
        return min(self.pages_per_request, self.swa_pages_per_request)


@dataclass(frozen=True, eq=False)
class ScheduledRequest:
    """One request: its room and where its data lives on each side.

    Pages map positionally (``src_pages[i]`` -> ``dst_pages[i]``); the state
    slot and aux row are the window slot on both sides (None when unused).
    ``content_seed`` seeds :mod:`pd_transfer.sim.content` for this request's
    bytes, so a destination still holding an earlier request's data is caught.
    """

    index: int
    room: int
    window_slot: int
    content_seed: int
    src_pages: np.ndarray
    dst_pages: np.ndarray
    src_swa_pages: np.ndarray
    dst_swa_pages: np.ndarray
    state_slot: int | None
    aux_row: int | None

    def chunks(self, chunk_pages: int) -> list[np.ndarray]:
        """Source pages split into sends of at most ``chunk_pages`` (one empty chunk if none)."""
        if chunk_pages <= 0:
            raise ValueError(f"chunk_pages must be positive, got {chunk_pages}")
        if len(self.src_pages) == 0:
            return [self.src_pages]
        return [self.src_pages[i : i + chunk_pages] for i in range(0, len(self.src_pages), chunk_pages)]

    @property
    def state_slots(self) -> tuple[int, ...]:
        return () if self.state_slot is None else (self.state_slot,)

    def transfer_indices(self) -> dict[Pool, tuple[np.ndarray, np.ndarray]]:
        """``Pool -> (src, dst)`` indices this request moves, for the content check."""
        indices = {Pool.KV: (self.src_pages, self.dst_pages)}
        if len(self.src_swa_pages):
            indices[Pool.SWA] = (self.src_swa_pages, self.dst_swa_pages)
        if self.state_slot is not None:
            slot = np.array([self.state_slot], dtype=np.int64)
            indices[Pool.MAMBA] = (slot, slot)
        if self.aux_row is not None:
            row = np.array([self.aux_row], dtype=np.int64)
            indices[Pool.AUX] = (row, row)
        return indices


def build_schedule(spec: ScheduleSpec) -> list[ScheduledRequest]:
    """The schedule of ``spec``; raises :class:`ConfigError` naming a pool that is too small."""
    _check(spec)
    blocks = {
        side: _blocks(spec, side, sizes.num_pages, spec.pages_per_request)
        for side, sizes in (("prefill", spec.prefill), ("decode", spec.decode))
    }
    swa_blocks = {
        side: _blocks(spec, f"{side}.swa", sizes.num_swa_pages, spec.swa_pages)
        for side, sizes in (("prefill", spec.prefill), ("decode", spec.decode))
    }
    requests = []
    for r in range(spec.num_requests):
        slot = r % spec.window
        room = spec.seed * ROOM_STRIDE + r
        pages = {
            side: _take(spec, f"{side}.{r}", blocks[side][slot], spec.pages_per_request) for side in blocks
        }
        # the window's pages are the request's *last* tokens; their SWA pages
        # are a separate index space, allocated like the full-attention pages
        swa = {
            side: _take(spec, f"{side}.swa.{r}", swa_blocks[side][slot], spec.swa_pages)
            for side in swa_blocks
        }
        requests.append(
            ScheduledRequest(
                index=r,
                room=room,
                window_slot=slot,
                content_seed=_content_seed(spec.seed, room),
                src_pages=pages["prefill"],
                dst_pages=pages["decode"],
                src_swa_pages=swa["prefill"],
                dst_swa_pages=swa["decode"],
                state_slot=slot if spec.uses_state else None,
                aux_row=slot if spec.uses_aux else None,
            )
        )
    return requests


def _check(spec: ScheduleSpec) -> None:
    for name in ("num_requests", "tokens", "page_size", "window"):
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"schedule.{name} must be a positive int, got {value!r}")
    if not 0 <= spec.seed <= MAX_SEED:
        raise ConfigError(f"schedule.seed must be in [0, {MAX_SEED}], got {spec.seed}")
    problems = []
    for side, sizes in (("prefill", spec.prefill), ("decode", spec.decode)):
        wanted = [("num_pages", spec.pages_per_request, "pages")]
        if spec.swa_pages:
            wanted.append(("num_swa_pages", spec.swa_pages, "SWA pages"))
        if spec.uses_state:
            wanted.append(("num_slots", 1, "state slot"))
        if spec.uses_aux:
            wanted.append(("num_aux_rows", 1, "aux row"))
        for field_name, per_request, what in wanted:
            have = getattr(sizes, field_name)
            if have < per_request * spec.window:
                problems.append(
                    f"{side}.{field_name} is {have} but {spec.window} rooms in flight "
                    f"need {per_request} {what} each ({per_request * spec.window})"
                )
    if problems:
        raise ConfigError(
            "the schedule does not fit the pools: " + "; ".join(problems),
            hint="raise the pool sizes, or lower --window or --tokens",
        )


def _rng(spec: ScheduleSpec, label: str) -> np.random.Generator:
    digest = hashlib.blake2b(f"{spec.seed}|{label}".encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(digest, "little"))


def _blocks(spec: ScheduleSpec, label: str, pool_size: int, per_request: int) -> list[np.ndarray]:
    """``window`` disjoint blocks of the pool, each holding at least ``per_request`` indices."""
    if per_request == 0:
        return [np.empty(0, np.int64)] * spec.window
    order = _rng(spec, f"blocks.{label}").permutation(pool_size) if spec.shuffle else np.arange(pool_size)
    block = pool_size // spec.window
    return [order[s * block : (s + 1) * block].astype(np.int64) for s in range(spec.window)]


def _take(spec: ScheduleSpec, label: str, block: np.ndarray, count: int) -> np.ndarray:
    if count == 0:
        return np.empty(0, np.int64)
    if not spec.shuffle:
        return np.sort(block)[:count]
    return _rng(spec, f"take.{label}").choice(block, count, replace=False).astype(np.int64)


def _content_seed(seed: int, room: int) -> int:
    digest = hashlib.blake2b(f"content|{seed}|{room}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
