"""Direct runs or staging, per peer pair and pool: the cost model and the choice.

An engine transport (Mooncake, NIXL) can move a plan two ways:

- **direct**: one engine descriptor per (joined) run, straight from the
  source region into the destination region;
- **staged**: gather the runs into a staging slot registered with the engine
  (numpy), move the slot with one bulk descriptor into a slot the decode side
  registered, and let decode scatter it into place (:mod:`~pd_transfer.transport.engines.staging.sender`).

Which is faster depends on the run sizes and on the path. A short probe at
connect (:func:`~pd_transfer.transport.engines.probe.measure_path`) fills a
:class:`PathCost`; per run and per byte the two ways then cost::

    direct  per_descriptor_s / m + fixed_s / (batch_descriptors * m) + 1 / engine_bytes_per_s
    staged  2 * (copy_per_run_s / m + 1 / copy_bytes_per_s)            # gather + scatter
            + (fixed_s + round_trip_s / ring_slots) / slot_nbytes + 1 / engine_bytes_per_s

for a mean run of ``m`` bytes. A chunk's round trip (decode told, decode
scattered and answered) overlaps the next chunks of the ring: with ``R`` slots
in flight each chunk waits for a share ``1 / R`` of it. Both are linear in
``1 / m``, so there is one **crossover** run size below which staging wins.
Worked example (Mooncake tcp on loopback): 80 us a descriptor, 2 us fixed,
copies at 4 GB/s and 40 ns a run, a 300 us round trip per 4 MiB slot, one
slot: crossover = (80 + 0.002 - 0.08) us / (0.5 ns + 0.072 ns) per byte,
about 140 KB (154 KB with the default ring of 4): 2 KiB and 16 KiB runs go
staged, 256 MiB blocks direct. The round trip is the noisiest term of the
probe (on a busy host, or while every sidecar probes its peers at once:
0.15 to 16 ms within one start-up), which is why it is shared out.

The pool's runs are profiled once at verdict time from a sample plan
(:class:`RunProfile`); an operator can force either way (``strategy =
"direct"`` or ``"staged"``). Pure: numpy and :mod:`~pd_transfer.transport.copy.runs` only; no engine, no
timing, no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from pd_transfer.transport.copy.runs import expand, flatten


class Strategy(enum.Enum):
    DIRECT = "direct"  # one descriptor per run (shm: a copy per run)
    STAGED = "staged"  # gathered into a bulk buffer, scattered on arrival (tcp: chunks)


class StrategyMode(enum.Enum):
    """What the configuration asks for (``strategy = auto|direct|staged``)."""

    AUTO = "auto"
    DIRECT = "direct"
    STAGED = "staged"


STRATEGY_MODES = tuple(m.value for m in StrategyMode)

# what the other transports do by construction, so that every verdict says
INHERENT = {
    "shm": Strategy.DIRECT,
    "device": Strategy.DIRECT,
    "mock": Strategy.DIRECT,
    "tcp": Strategy.STAGED,
}


@dataclass(frozen=True)
class PathCost:
    """What moving bytes to one peer costs, measured at connect (seconds, bytes per second).

    ``fixed_s``: one engine submission of one tiny descriptor;
    ``per_descriptor_s``: each further descriptor in a submission;
    ``engine_bytes_per_s``: bulk bandwidth of one large descriptor;
    ``copy_bytes_per_s`` / ``copy_per_run_s``: a numpy gather on this host
    (decode's scatter is assumed to cost the same), the bandwidth from memory
    out of cache, the cost per run with the caches warm (a run's misses cost
    the direct way as much);
    ``round_trip_s``: one staged chunk's notification and acknowledgement.
    """

    fixed_s: float
    per_descriptor_s: float
    engine_bytes_per_s: float
    copy_bytes_per_s: float
    copy_per_run_s: float
    round_trip_s: float

    def describe(self) -> str:
        return (
            f"{self.per_descriptor_s * 1e6:.1f} us/descriptor, {self.fixed_s * 1e6:.0f} us "
            f"fixed, engine {self.engine_bytes_per_s / 1e9:.2f} GB/s, copy "
            f"{self.copy_bytes_per_s / 1e9:.2f} GB/s + {self.copy_per_run_s * 1e9:.0f} ns/run, "
            f"round trip {self.round_trip_s * 1e6:.0f} us"
        )


@dataclass(frozen=True)
class RunProfile:
    """The run sizes of a plan (or of one pool's part of it), after joining."""

    num_runs: int
    total_nbytes: int
    p10_nbytes: int
    median_nbytes: int
    p90_nbytes: int

    @property
    def mean_nbytes(self) -> float:
        return self.total_nbytes / self.num_runs if self.num_runs else 0.0

    @classmethod
    def of(cls, nbytes: np.ndarray) -> RunProfile:
        nbytes = np.asarray(nbytes, np.int64)
        if not len(nbytes):
            return cls(0, 0, 0, 0, 0)
        p10, p50, p90 = (int(v) for v in np.percentile(nbytes, (10, 50, 90), method="nearest"))
        return cls(len(nbytes), int(nbytes.sum()), p10, p50, p90)

    def describe(self) -> str:
        return (
            f"{self.num_runs} runs, median {self.median_nbytes} B (p10 {self.p10_nbytes}, "
            f"p90 {self.p90_nbytes})"
        )


@dataclass(frozen=True)
class StrategyChoice:
    """The strategy for one (peer, pool), and why."""

    strategy: Strategy
    reason: str
    profile: RunProfile | None = None

    def describe(self) -> str:
        return f"{self.strategy.value} ({self.reason})"


def joined_runs(plan) -> tuple[np.ndarray, np.ndarray]:
    """``(batch index, nbytes)`` of every run of ``plan`` once neighbours are joined.

    Two runs join, as the engines' lowering joins them, when they come from
    the same batch and continue each other on both sides: pages 4 and 5 of
    one layer, contiguous in both pools, make one run.
    """
    runs = expand(flatten(plan))
    if not len(runs):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    continues = (
        (runs.batch[1:] == runs.batch[:-1])
        & (runs.src_offset[1:] == runs.src_offset[:-1] + runs.nbytes[:-1])
        & (runs.dst_offset[1:] == runs.dst_offset[:-1] + runs.nbytes[:-1])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return runs.batch[starts], np.add.reduceat(runs.nbytes, starts)


def crossover_nbytes(
    cost: PathCost, *, slot_nbytes: int, batch_descriptors: int, ring_slots: int = 1
) -> float:
    """The mean run size below which staging is estimated faster (0: never)."""
    saved_per_run = cost.per_descriptor_s + cost.fixed_s / batch_descriptors - 2 * cost.copy_per_run_s
    added_per_byte = (
        2 / cost.copy_bytes_per_s + (cost.fixed_s + cost.round_trip_s / max(1, ring_slots)) / slot_nbytes
    )
    if saved_per_run <= 0:
        return 0.0
    return saved_per_run / added_per_byte


def estimate_s(
    profile: RunProfile,
    cost: PathCost,
    strategy: Strategy,
    *,
    slot_nbytes: int,
    batch_descriptors: int,
    ring_slots: int = 1,
) -> float:
    """Estimated seconds to move ``profile`` one way (for logs and benchmarks)."""
    n, total = profile.num_runs, profile.total_nbytes
    wire = total / cost.engine_bytes_per_s
    if strategy is Strategy.DIRECT:
        return -(-n // batch_descriptors) * cost.fixed_s + n * cost.per_descriptor_s + wire
    chunks = -(-total // slot_nbytes)
    return (
        chunks * (cost.fixed_s + cost.round_trip_s / max(1, ring_slots))
        + wire
        + 2 * (total / cost.copy_bytes_per_s + n * cost.copy_per_run_s)
    )


def choose(
    profile: RunProfile,
    cost: PathCost | None,
    mode: StrategyMode = StrategyMode.AUTO,
    *,
    slot_nbytes: int,
    batch_descriptors: int,
    staging: bool = True,
    ring_slots: int = 1,
) -> StrategyChoice:
    """Direct or staged for runs like ``profile`` over a path costing ``cost``.

    ``staging`` False (the peer offers no staging area, or it is full)
    forces direct whatever is asked; ``cost`` None (not measured) means
    direct under ``auto``.
    """
    if not staging:
        return StrategyChoice(Strategy.DIRECT, "the peer offers no staging slots", profile)
    if mode is StrategyMode.DIRECT:
        return StrategyChoice(Strategy.DIRECT, "configured", profile)
    if mode is StrategyMode.STAGED:
        return StrategyChoice(Strategy.STAGED, "configured", profile)
    if cost is None:
        return StrategyChoice(Strategy.DIRECT, "path not measured", profile)
    if not profile.num_runs:
        return StrategyChoice(Strategy.DIRECT, "no runs", profile)
    crossover = crossover_nbytes(
        cost, slot_nbytes=slot_nbytes, batch_descriptors=batch_descriptors, ring_slots=ring_slots
    )
    staged = profile.mean_nbytes < crossover
    return StrategyChoice(
        Strategy.STAGED if staged else Strategy.DIRECT,
        f"mean run {profile.mean_nbytes:.0f} B {'<' if staged else '>='} crossover {crossover:.0f} B",
        profile,
    )


def staged_batches(plan, crossover: float) -> np.ndarray:
    """Per batch of ``plan``: is its mean joined run below ``crossover`` bytes?"""
    batch, nbytes = joined_runs(plan)
    num = len(plan.batches)
    runs = np.bincount(batch, minlength=num)
    total = np.bincount(batch, weights=nbytes, minlength=num)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(runs > 0, total / np.maximum(runs, 1), np.inf)
    return mean < crossover
