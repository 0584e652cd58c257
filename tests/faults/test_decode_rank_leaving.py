"""A decode rank that leaves fails only the rooms that still needed it.

Prefill TP 1 feeds decode TP 2: the prefill rank writes half of every page's
heads to each decode rank, so every room has a target on both decode ranks.
Decode rank 1's worker finishes its part of room 1 and exits; its sidecar
then closes its sessions, as it does whenever its worker goes. Room 1 is
still live on the prefill rank (decode rank 0 has not asked for it yet):
rank 1's part of it is settled, so the Close must not fail it, and rank 0
then receives room 1 byte-exact. Room 2, which rank 1 had asked for and not
received, needed bytes to the rank that left: it fails, on both sides.

The order is the test's, not the scheduler's: the prefill sidecar has
processed the Close once it unmapped rank 1's segments (its link to the rank
is released then), checked in its ``/proc/PID/maps`` before rank 0 asks.
"""

from pathlib import Path

from fault_tools import TERMINAL, check_sim, fill_sim, kv_requests, tiny_ranks, wait_for, wait_status

from pd_transfer.client import RoomStatus
from pd_transfer.layout.geometry import Role

NUM_PAGES = 32
SEED = 23


def _maps_any(cluster, prefill, rank) -> bool:
    """Whether ``prefill``'s sidecar maps a segment of decode ``rank``'s pools."""
    segments = set(cluster.pools[rank.rank_id].handles.values())
    maps = Path(f"/proc/{cluster.sidecars[prefill.rank_id].proc.pid}/maps").read_text()
    return any(line.rsplit("/", 1)[-1] in segments for line in maps.splitlines())


def test_a_decode_rank_leaving_after_its_part_fails_only_the_rooms_that_needed_it(deployment):
    cluster = deployment(
        tiny_ranks(Role.PREFILL, 1, num_pages=NUM_PAGES), tiny_ranks(Role.DECODE, 2, num_pages=NUM_PAGES)
    )
    fill_sim(cluster, SEED)
    (prefill,), (rank0, rank1) = cluster.prefill, cluster.decode
    source = cluster.clients[prefill.rank_id]
    leaving, staying = cluster.clients[rank1.rank_id], cluster.clients[rank0.rank_id]
    settled = kv_requests(range(0, 4), range(8, 12))

    # room 1: decode rank 1 asks, the prefill rank writes its half, rank 1 has it
    leaving.expect(1, cluster.bootstrap, list(range(8, 12)))
    wait_status(leaving, 1, [RoomStatus.WAITING_FOR_INPUT])
    source.send(1, list(range(0, 4)))
    assert leaving.wait(1, timeout_s=15).status is RoomStatus.SUCCESS
    assert source.poll(1).status not in TERMINAL  # decode rank 0's part is still to come
    # room 2: rank 1 asks and leaves before a byte of it was sent
    leaving.expect(2, cluster.bootstrap, list(range(16, 20)))
    wait_status(leaving, 2, [RoomStatus.WAITING_FOR_INPUT])

    leaving.close()  # decode rank 1's worker exits: its sidecar closes its prefill sessions
    wait_for(lambda: not _maps_any(cluster, prefill, rank1), 15, "prefill releasing decode rank 1")

    staying.expect(1, cluster.bootstrap, list(range(8, 12)))
    state = staying.wait(1, timeout_s=15)
    assert state.status is RoomStatus.SUCCESS, state.reason
    assert source.wait(1, timeout_s=15).status is RoomStatus.SUCCESS
    assert check_sim(cluster, SEED, settled) == []

    failed = wait_status(source, 2, TERMINAL)
    assert failed.status is RoomStatus.FAILED, failed
    assert "decode[pp0,tp1]" in failed.reason, failed.reason
    staying.expect(2, cluster.bootstrap, list(range(16, 20)))
    state = staying.wait(2, timeout_s=15)
    assert state.status is RoomStatus.FAILED, state
