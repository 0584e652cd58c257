"""The strategy choice: small runs go staged, big runs direct, the configuration wins."""

from __future__ import annotations

import numpy as np
import pytest

from pd_transfer.layout.lowering import RunBatch, TransferPlan
from pd_transfer.transport.engines.strategy import (
    PathCost,
    RunProfile,
    Strategy,
    StrategyMode,
    choose,
    crossover_nbytes,
    estimate_s,
    joined_runs,
    staged_batches,
)

# the worked example of strategy.py's docstring: Mooncake's tcp path on loopback
MOONCAKE_TCP = PathCost(
    fixed_s=2e-6,
    per_descriptor_s=80e-6,
    engine_bytes_per_s=0.5e9,
    copy_bytes_per_s=4e9,
    copy_per_run_s=40e-9,
    round_trip_s=300e-6,
)
# a path where descriptors are nearly free (RDMA-like): staging never pays
CHEAP_DESCRIPTORS = PathCost(
    fixed_s=5e-6,
    per_descriptor_s=50e-9,
    engine_bytes_per_s=20e9,
    copy_bytes_per_s=4e9,
    copy_per_run_s=40e-9,
    round_trip_s=50e-6,
)
SLOT = 4 << 20


def _choose(run_nbytes: int, cost=MOONCAKE_TCP, mode=StrategyMode.AUTO, **kw):
    profile = RunProfile.of(np.full(4096, run_nbytes))
    return choose(profile, cost, mode, slot_nbytes=SLOT, batch_descriptors=1024, **kw)


def test_crossover_matches_the_worked_example():
    crossover = crossover_nbytes(MOONCAKE_TCP, slot_nbytes=SLOT, batch_descriptors=1024)
    assert 139_000 < crossover < 141_000
    ring = crossover_nbytes(MOONCAKE_TCP, slot_nbytes=SLOT, batch_descriptors=1024, ring_slots=4)
    assert 153_000 < ring < 155_000  # a chunk waits for a quarter of its round trip


def test_a_slow_round_trip_at_start_up_is_shared_out_over_the_ring():
    """A NIXL link's probe while six sidecars started at once on two cores (from a
    sidecar's log): a 16 ms round trip. Charged whole to every chunk it sent 512-byte
    head slices direct, one descriptor each (a request took 2-5 s instead of 1); shared
    over the four chunks in flight, they go staged."""
    noisy = PathCost(
        fixed_s=118e-6,
        per_descriptor_s=1.1e-6,
        engine_bytes_per_s=0.84e9,
        copy_bytes_per_s=6.10e9,
        copy_per_run_s=188e-9,
        round_trip_s=15.894e-3,
    )
    profile = RunProfile.of(np.full(1024, 512))
    one, ring = (
        choose(profile, noisy, slot_nbytes=SLOT, batch_descriptors=1 << 30, ring_slots=r).strategy
        for r in (1, 4)
    )
    assert (one, ring) == (Strategy.DIRECT, Strategy.STAGED)


@pytest.mark.parametrize("run_nbytes", [512, 2048, 16384, 65536])
def test_small_runs_go_staged(run_nbytes):
    decision = _choose(run_nbytes)
    assert decision.strategy is Strategy.STAGED and "crossover" in decision.reason


@pytest.mark.parametrize("run_nbytes", [1 << 20, 256 << 20])
def test_big_runs_go_direct(run_nbytes):
    assert _choose(run_nbytes).strategy is Strategy.DIRECT


def test_a_path_with_cheap_descriptors_never_stages():
    assert crossover_nbytes(CHEAP_DESCRIPTORS, slot_nbytes=SLOT, batch_descriptors=1024) == 0
    assert _choose(64, CHEAP_DESCRIPTORS).strategy is Strategy.DIRECT


@pytest.mark.parametrize(
    "mode,run_nbytes,expected",
    [(StrategyMode.DIRECT, 512, Strategy.DIRECT), (StrategyMode.STAGED, 256 << 20, Strategy.STAGED)],
)
def test_the_configured_strategy_overrides_the_estimate(mode, run_nbytes, expected):
    decision = _choose(run_nbytes, mode=mode)
    assert decision.strategy is expected and decision.reason == "configured"


def test_no_staging_slots_or_no_measurement_means_direct():
    assert _choose(512, staging=False).strategy is Strategy.DIRECT
    assert _choose(512, mode=StrategyMode.STAGED, staging=False).strategy is Strategy.DIRECT
    assert _choose(512, cost=None).reason == "path not measured"


@pytest.mark.parametrize("ring_slots", [1, 4])
@pytest.mark.parametrize("run_nbytes", [2048, 16384, 150_000, 1 << 20])
def test_the_choice_agrees_with_the_time_estimates(run_nbytes, ring_slots):
    # a request of 256 MiB in runs of run_nbytes: the chosen way is the faster estimate
    total = 256 << 20
    profile = RunProfile.of(np.full(total // run_nbytes, run_nbytes))
    times = {
        s: estimate_s(
            profile, MOONCAKE_TCP, s, slot_nbytes=SLOT, batch_descriptors=1024, ring_slots=ring_slots
        )
        for s in Strategy
    }
    assert _choose(run_nbytes, ring_slots=ring_slots).strategy is min(times, key=times.get)


def test_run_profile_reports_percentiles_and_mean():
    profile = RunProfile.of(np.array([100] * 8 + [1000, 10000]))
    assert (profile.num_runs, profile.total_nbytes) == (10, 11800)
    assert (profile.p10_nbytes, profile.median_nbytes, profile.p90_nbytes) == (100, 100, 1000)
    assert profile.mean_nbytes == 1180
    assert RunProfile.of(np.zeros(0)).num_runs == 0


def _batch(src, dst, n, region="kv"):
    return RunBatch(
        region,
        region,
        np.array(src, np.int64),
        np.array(dst, np.int64),
        np.array(n, np.int64),
        np.ones(len(n), np.int64),
        0,
        0,
    )


def test_runs_that_continue_on_both_sides_are_joined_before_profiling():
    # pages 0-3 land in pages 10-13: one run of 4 KiB; then two runs that do not continue
    plan = TransferPlan(
        "p",
        "d",
        (
            _batch([0, 1024, 2048, 3072, 8192], [10240, 11264, 12288, 13312, 0], [1024] * 5),
            _batch([0, 4096], [4096, 0], [64, 64], region="aux"),
        ),
    )
    batch, nbytes = joined_runs(plan)
    assert batch.tolist() == [0, 0, 1, 1] and nbytes.tolist() == [4096, 1024, 64, 64]
    assert staged_batches(plan, crossover=1000).tolist() == [False, True]
    assert staged_batches(plan, crossover=0).tolist() == [False, False]


def test_the_config_and_the_metrics_name_the_same_strategies():
    from pd_transfer.agent.observe import STRATEGIES as reported
    from pd_transfer.config.sidecar import STRATEGIES as configurable

    assert configurable == tuple(m.value for m in StrategyMode)
    assert reported == tuple(s.value for s in Strategy)
