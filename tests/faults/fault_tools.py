"""Helpers of the fault-injection and fuzz tests: deployments, restarts, leaks, metrics.

Builds on :mod:`cluster` (tests/agent): sidecars are real ``pd-transfer serve``
processes, workers are the test through the real client library (or, where a
worker must die, a child process speaking the worker API).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import msgpack
import numpy as np
from cluster import Cluster, Sidecar, poll_known

from pd_transfer.client import RoomStatus
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.presets import model_from_table
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import Layout, Pool
from pd_transfer.memory.segments import SEGMENT_DIR
from pd_transfer.sim.content import check_destination, fill_source

TINY = {
    "name": "tiny",
    "num_layers": 2,
    "layer_cycle": ["attention"],
    "attention": {"num_kv_heads": 4, "head_dim": 8},
}
TERMINAL = (RoomStatus.SUCCESS, RoomStatus.FAILED)


def tiny_ranks(role: Role, tp: int, **kwargs):
    """A 2-layer GQA model, 4 KV heads of 8: a page of one layer's K is 4 tokens x 4 x 8 x 2 B."""
    shape = {"page_size": 4, "kv_layout": Layout.NHD, "num_pages": 16, "num_aux_rows": 4, **kwargs}
    return build_instance(model_from_table(dict(TINY), "tiny"), role, tp, **shape)


def kv_requests(src, dst) -> dict:
    return {Pool.KV: (np.asarray(src, np.int64), np.asarray(dst, np.int64))}


class Deployments:
    """Clusters made for one test, closed and checked for leaks at its end."""

    def __init__(self) -> None:
        # a short directory: ipc:// socket paths are limited to ~100 characters
        self.workdir = Path(tempfile.mkdtemp(prefix="pdt-"))
        self.clusters: list[Cluster] = []

    def make(self, prefill, decode, **kwargs) -> Cluster:
        cluster = Cluster(self.workdir, prefill, decode, **kwargs)
        self.clusters.append(cluster)
        return cluster

    def close(self) -> list[str]:
        """Stop everything; what leaked or exited badly, one line each (empty: clean)."""
        problems = []
        for cluster in self.clusters:
            killed = {name for name, s in sidecars_of(cluster) if s.proc.poll() is not None}
            for client in cluster.clients.values():
                client.close()
            running = [s for _, s in sidecars_of(cluster) if s.proc.poll() is None]
            for sidecar in running:  # all at once: each drains on its own
                sidecar.proc.send_signal(signal.SIGTERM)
            for sidecar in running:  # one signal each: a second one would force the stop
                try:
                    sidecar.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    problems.append(f"sidecar {sidecar.name} still running 15 s after SIGTERM")
            cluster.close()
            for name, sidecar in sidecars_of(cluster):
                code = sidecar.proc.returncode
                if name not in killed and code != 0:
                    problems.append(
                        f"sidecar {name} exited {code} on SIGTERM: {sidecar.log.read_text()[-1500:]}"
                    )
            problems += [f"segment {s} left in {SEGMENT_DIR}" for s in segments_of(cluster)]
        shutil.rmtree(self.workdir, ignore_errors=True)
        return problems


def sidecars_of(cluster: Cluster) -> list[tuple[str, Sidecar]]:
    """Every sidecar process the cluster ran, restarted ones' predecessors included."""
    out = []
    for rank_id, sidecar in cluster.sidecars.items():
        retired = getattr(cluster, "retired", {}).get(rank_id, [])
        out += [(f"{s.name}#run{i}", s) for i, s in enumerate(retired)]
        out.append((sidecar.name, sidecar))
    return out


def segments_of(cluster: Cluster) -> list[str]:
    """Segments in /dev/shm whose names carry the cluster's tag."""
    prefix = f"pdt-t{cluster._tag}-"
    return sorted(name for name in os.listdir(SEGMENT_DIR) if name.startswith(prefix))


def restart_sidecar(cluster: Cluster, rank_id: str) -> Sidecar:
    """Start a new sidecar for ``rank_id`` with the old one's name, config and endpoints."""
    old = cluster.sidecars[rank_id]
    if old.proc.poll() is None:
        raise RuntimeError(f"{old.name} is still running")
    config_path = cluster.workdir / f"{old.name}.toml"
    config = tomllib.loads(config_path.read_text())["sidecar"]
    old.ready.unlink(missing_ok=True)
    retired = cluster.__dict__.setdefault("retired", {}).setdefault(rank_id, [])
    saved_log = old.log.with_name(f"{old.name}.run{len(retired)}.log")
    old.log.rename(saved_log)
    old.log = saved_log
    retired.append(old)
    new = Sidecar(
        cluster.workdir,
        old.role,
        old.name,
        config,
        cluster.bootstrap if old.role == "prefill" else "",
        old.endpoint.split("://")[0],
    )
    cluster.sidecars[rank_id] = new
    cluster.ready[rank_id] = new.wait_ready()
    return new


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.02):
    """Poll ``predicate`` until it returns a truthy value; raise naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(interval_s)


def wait_status(client, room: int, statuses, timeout_s: float = 60.0):
    """Poll until ``room`` is in one of ``statuses``; a room the sidecar does not know
    yet (its request still on the way, over another socket) is polled again."""
    statuses = tuple(statuses)
    return wait_for(
        lambda: (s := poll_known(client, room)) is not None and s.status in statuses and s,
        timeout_s,
        f"room {room} reaching {[s.value for s in statuses]}",
    )


def snapshot(cluster: Cluster, role: Role) -> dict[tuple[str, str], np.ndarray]:
    """A copy of every region of every rank of ``role``: the guard bytes."""
    ranks = cluster.prefill if role is Role.PREFILL else cluster.decode
    return {
        (g.rank_id, region_id): array.copy()
        for g in ranks
        for region_id, array in cluster.pools[g.rank_id].arrays.items()
    }


def changed_regions(cluster: Cluster, before: dict[tuple[str, str], np.ndarray]) -> list[str]:
    """Regions whose bytes differ from ``before``: 'rank region: N bytes changed from byte B'."""
    out = []
    for (rank, region_id), old in before.items():
        now = cluster.pools[rank].arrays[region_id]
        diff = np.flatnonzero(now != old)
        if diff.size:
            out.append(f"{rank} {region_id}: {diff.size} bytes changed from byte {int(diff[0])}")
    return out


def fill_sim(cluster: Cluster, seed: int) -> None:
    """Overwrite every prefill pool with the sim's deterministic content of ``seed``."""
    for geometry in cluster.prefill:
        fill_source(geometry, cluster.pools[geometry.rank_id].arrays, seed)


def check_sim(cluster: Cluster, seed: int, requests: dict) -> list[str]:
    """Discrepancies of the requested decode items (only those) against the sim content."""
    lines = []
    for geometry in cluster.decode:
        lines += check_destination(geometry, cluster.pools[geometry.rank_id].arrays, seed, requests)
    return lines


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def metric_total(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` in Prometheus text whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or match["name"] != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match["labels"] or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match["value"])
    return total


def metric_by_label(text: str, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or match["name"] != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match["labels"] or ""))
        out[found.get(label, "")] = out.get(found.get(label, ""), 0.0) + float(match["value"])
    return out


# -- a worker in its own process, to be killed --------------------------------------

_CHILD_WORKER = r"""
import socket, struct, sys, zmq, msgpack
endpoint, path = sys.argv[1], sys.argv[2]
if endpoint.startswith("unix://"):   # a plain stream: length-prefixed frames
    stream = socket.socket(socket.AF_UNIX)
    stream.settimeout(20)
    stream.connect(endpoint[len("unix://"):])
    def exchange(frame):
        stream.sendall(struct.pack("<I", len(frame)) + frame)
        data = b""
        while len(data) < 4 or len(data) < 4 + struct.unpack("<I", data[:4])[0]:
            chunk = stream.recv(65536)
            if not chunk:
                print("closed", flush=True)
                sys.exit(3)
            data += chunk
        return data[4:]
else:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    def exchange(frame):
        dealer.send(frame)
        if not dealer.poll(20000):
            print("no reply", flush=True)
            sys.exit(3)
        return dealer.recv()
for frame in msgpack.unpackb(open(path, "rb").read()):
    reply = msgpack.unpackb(exchange(frame), raw=False)
    if not reply.get("ok"):
        print("refused", reply, flush=True)
        sys.exit(4)
print("sent", flush=True)
sys.stdin.read()   # until killed
"""


def start_child_worker(endpoint: str, requests: list[dict], workdir: Path) -> subprocess.Popen:
    """A worker process that sends ``requests`` (worker API maps) in order, then idles.

    It imports only zmq and msgpack, so it starts in a fraction of a second;
    returns once every request was answered ok (raises otherwise).
    """
    from pd_transfer.protocol.worker_api import encode

    path = workdir / f"child-worker-{os.getpid()}-{time.monotonic_ns()}.msgpack"
    path.write_bytes(
        msgpack.packb([encode({**r, "id": i + 1}) for i, r in enumerate(requests)], use_bin_type=True)
    )
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD_WORKER, endpoint, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = child.stdout.readline().strip()
    if line != "sent":
        child.kill()
        child.wait()
        raise RuntimeError(f"child worker: {line!r}")
    return child


def kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()
