"""Every background task of a sidecar has an owner: kept, its failure logged, awaited at shutdown.

A task started with ``asyncio.create_task`` and dropped can be collected
while it runs, and its exception surfaces, if at all, as asyncio's "Task
exception was never retrieved" long after the room it belonged to. The
sidecar starts its background work through :class:`~pd_transfer.agent.tasks.Tasks`.
"""

from __future__ import annotations

import ast
import asyncio
import logging
import time
from pathlib import Path

import numpy as np
import pytest

import pd_transfer.agent
from pd_transfer.agent.tasks import Tasks
from pd_transfer.client import RoomStatus
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.presets import model_from_table
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import Layout, Pool

AGENT = Path(pd_transfer.agent.__file__).resolve().parent
TINY = {
    "name": "tiny",
    "num_layers": 2,
    "layer_cycle": ["attention"],
    "attention": {"num_kv_heads": 4, "head_dim": 8},
}
ORPHANS = ("Task exception was never retrieved", "Task was destroyed but it is pending")


def test_no_task_result_is_dropped_in_the_agent():
    dropped = []
    for path in sorted(AGENT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr in ("create_task", "ensure_future")
            ):
                dropped.append(f"{path.name}:{node.lineno}")
    assert dropped == [], f"tasks started and dropped (use sidecar.spawn): {dropped}"


def test_a_failed_task_is_logged_with_its_room_and_peer_and_close_awaits_the_rest(caplog):
    async def main() -> tuple[bool, int]:
        tasks = Tasks()

        async def fails() -> None:
            raise RuntimeError("the copy broke")

        forever = asyncio.Event()
        waiting = tasks.spawn(forever.wait(), room="r2")
        tasks.spawn(fails(), room="r1", peer="decode[pp0,tp0]")
        await asyncio.sleep(0.05)
        assert len(tasks) == 1
        await tasks.close()
        return waiting.cancelled(), len(tasks)

    with caplog.at_level(logging.ERROR, logger="pd_transfer.agent"):
        cancelled, left = asyncio.run(main())
    assert cancelled and left == 0
    failed = [r for r in caplog.records if "background task" in r.getMessage()]
    assert len(failed) == 1
    text = failed[0].getMessage()
    assert "room r1" in text and "decode[pp0,tp0]" in text and "the copy broke" in text
    assert failed[0].exc_info is not None


def _ranks(role: Role):
    shape = {"page_size": 4, "kv_layout": Layout.NHD, "num_pages": 8, "num_aux_rows": 4}
    return build_instance(model_from_table(dict(TINY), "tiny"), role, 1, **shape)


@pytest.mark.parametrize("first", ["prefill", "decode"])
def test_a_busy_sidecar_stops_with_no_task_left_behind(cluster_factory, first):
    """Rooms mid-way on both sides; SIGTERM one sidecar, then the other: both exit 0,
    and neither log reports a task dropped or destroyed while pending."""
    prefill, decode = _ranks(Role.PREFILL), _ranks(Role.DECODE)
    cluster = cluster_factory(prefill, decode)
    client = cluster.clients[decode[0].rank_id]
    for room in (1, 2, 3):
        pages = np.array([room, room + 3]) % 8
        cluster.expect(room, {Pool.KV: (pages, pages), Pool.AUX: (np.array([room]), np.array([room]))})
    deadline = time.monotonic() + 5
    while client.poll(3).status is RoomStatus.BOOTSTRAPPING and time.monotonic() < deadline:
        time.sleep(0.02)
    cluster.clients[prefill[0].rank_id].send(1, [1], last_chunk=False)  # live on both sides
    order = [prefill[0].rank_id, decode[0].rank_id]
    if first == "decode":
        order.reverse()
    for rank in order:
        sidecar = cluster.sidecars[rank]
        sidecar.stop()
        log = sidecar.log.read_text()
        assert sidecar.proc.returncode == 0, log[-2000:]
        assert not [line for line in log.splitlines() if any(o in line for o in ORPHANS)], log[-2000:]
        assert "background task" not in log, log[-2000:]
