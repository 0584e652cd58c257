"""Shared by test_mooncake and test_nixl: a receiver process over the parent's shm segments."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import numpy as np

from pd_transfer.layout.lowering import RunBatch, TransferPlan
from pd_transfer.transport import PeerEndpoint

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine_receiver_child.py")


class ReceiverProcess:
    """``engine_receiver_child.py`` serving ``{rank: {region: Segment}}``; addresses by rank."""

    def __init__(self, kind: str, placed: dict) -> None:
        self.kind = kind
        self.placed = placed
        self.proc: asyncio.subprocess.Process | None = None
        self.addresses: dict[str, str] = {}

    async def start(self) -> ReceiverProcess:
        names = {rank: {r: s.name for r, s in segs.items()} for rank, segs in self.placed.items()}
        env = dict(os.environ, PYTHONPATH=os.getcwd())
        env.setdefault("UCX_MODULES", "^ib")
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, CHILD, json.dumps({"kind": self.kind, "ranks": names}), env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        line = await asyncio.wait_for(self.proc.stdout.readline(), 120)
        if not line:
            raise RuntimeError(f"{self.kind} receiver child exited with {await self.proc.wait()}")
        self.addresses = json.loads(line)
        return self

    def endpoint(self, rank: str, sizes: dict[str, int] | None = None) -> PeerEndpoint:
        sizes = sizes or {r: s.nbytes for r, s in self.placed[rank].items()}
        return PeerEndpoint.from_maps(rank, sizes, data_address=self.addresses[rank])

    async def unregister(self, rank: str, region_id: str, verb: str = "unregister") -> None:
        """Take a region (or ``"staging"``, the staging area) away from the rank's engine;
        ``verb="register"`` gives the staging area back."""
        self.proc.stdin.write(f"{verb} {rank} {region_id}\n".encode())
        await self.proc.stdin.drain()
        assert (await asyncio.wait_for(self.proc.stdout.readline(), 30)).strip() == b"ok"

    async def kill(self) -> None:
        self.proc.kill()
        await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def copy_back(sc, placed: dict) -> None:
    for rank, segs in placed.items():
        for region_id, segment in segs.items():
            sc.world.decode_buffers[rank][region_id][:] = segment.array


def scattered_plan(region: str, num_runs: int, run_nbytes: int, seed: int = 0) -> TransferPlan:
    """``num_runs`` runs to distinct, non-neighbouring destination slots (nothing joins)."""
    rng = np.random.default_rng(seed)
    slots = rng.permutation(2 * num_runs)[:num_runs] * 2  # even slots only: never adjacent
    src = np.arange(num_runs, dtype=np.int64) * 2 * run_nbytes
    batch = RunBatch(region, region, src, slots.astype(np.int64) * run_nbytes,
                     np.full(num_runs, run_nbytes, np.int64), np.ones(num_runs, np.int64), 0, 0)
    return TransferPlan("p0", "d0", (batch,))


def expected_scatter(plan: TransferPlan, src: np.ndarray, dst_before: np.ndarray) -> np.ndarray:
    out = dst_before.copy()
    for s, d, n in zip(*plan.batches[0].byte_runs()):
        out[d:d + n] = src[s:s + n]
    return out
