"""Sidecars with a shared secret (and optionally CURVE keys), and an intruder's tools."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import zmq
from cluster import Cluster
from prometheus_client.parser import text_string_to_metric_families

from pd_transfer.agent.auth import SecureContext, Security
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.presets import model_from_table
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import Layout, Pool
from pd_transfer.security import SecuritySettings, parse_secret

TINY = {
    "name": "tiny",
    "num_layers": 2,
    "layer_cycle": ["attention"],
    "attention": {"num_kv_heads": 4, "head_dim": 8},
}
SECRET_HEX = "a11ce5" + "0f" * 29
WRONG_HEX = "b0b0b0" + "f0" * 29


def ranks(role: Role, tp: int):
    shape = {"page_size": 4, "kv_layout": Layout.NHD, "num_pages": 8, "num_aux_rows": 2}
    return build_instance(model_from_table(dict(TINY), "tiny"), role, tp, **shape)


# two rooms on disjoint destination pages and rows, so one world checks both at once
ROOMS = {
    1: {Pool.KV: (np.array([5, 2, 7]), np.array([0, 1, 2])), Pool.AUX: (np.array([0]), np.array([1]))},
    2: {Pool.KV: (np.array([1, 3, 6]), np.array([3, 4, 5])), Pool.AUX: (np.array([1]), np.array([0]))},
}


def requests(*rooms: int) -> dict:
    """The requests of ``rooms`` together (the oracle checks every byte so far)."""
    return {
        pool: tuple(np.concatenate([ROOMS[r][pool][side] for r in rooms]) for side in (0, 1))
        for pool in ROOMS[rooms[0]]
    }


def write_secret(directory, name: str, text: str):
    path = directory / name
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def start(workdir, prefill, decode, secret_file, config=None, **options) -> Cluster:
    """A cluster whose sidecars read ``secret_file``; its workers' clients get it from
    the environment (only while they attach, so later sidecars do not inherit it).
    ``options``: more :class:`Cluster` arguments (``transport``, ``decode_config``)."""
    cluster = Cluster(
        workdir,
        prefill,
        decode,
        attach=False,
        config={"secret_file": str(secret_file), **(config or {})},
        **options,
    )
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PD_TRANSFER_SECRET_FILE", str(secret_file))
            cluster.attach_all()
    except BaseException:
        cluster.close()
        raise
    return cluster


def security(secret_hex: str | None = None, agent_id: str = "intruder", **settings) -> Security:
    secret = parse_secret(secret_hex.encode(), "test") if secret_hex else None
    return Security(SecuritySettings(secret=secret, **settings), agent_id, handshake_timeout_s=3.0)


def run_with(security_: Security, coroutine_factory):
    """Run ``coroutine_factory(context)`` on a fresh loop with a context carrying ``security_``."""

    async def main():
        context = SecureContext(security_)
        try:
            return await coroutine_factory(context)
        finally:
            context.destroy(linger=0)

    return asyncio.run(main())


def metric(cluster: Cluster, rank: str, name: str, **labels) -> float:
    status, text = cluster.http(rank, "/metrics")
    assert status == 200
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


class RawPeer:
    """A bare DEALER: sends what the test says, returns what comes back (or None)."""

    def __init__(self, address: str, routing_id: bytes | None = None) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            self.socket.setsockopt(zmq.ROUTING_ID, routing_id)
        self.socket.connect(address)

    def ask(self, frame: bytes, timeout_s: float = 3.0) -> bytes | None:
        self.socket.send(frame)
        return self.receive(timeout_s)

    def receive(self, timeout_s: float = 3.0) -> bytes | None:
        deadline = time.monotonic() + timeout_s
        if self.socket.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            return self.socket.recv()
        return None

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()
