"""A real prefill + decode deployment on this machine, for integration tests.

Sidecars run as separate processes (``python -m pd_transfer.cli serve``),
talking over ZeroMQ on 127.0.0.1, each serving its worker on ``unix://`` (or
``ipc://``: ``worker_scheme``); workers are played by the
test through the real client library, with pools in real shared memory. The
bytes come from the oracle (:class:`pd_transfer.testing.World`): its prefill
buffers are copied into the prefill segments, its decode buffers into the
decode segments, and after the transfer the decode segments are copied back
and checked by the oracle.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pd_transfer.client import Client, Refused, allocate_pools
from pd_transfer.client.cuda_pools import allocate_cuda_pools
from pd_transfer.config.extras import ENGINES
from pd_transfer.errors import GeometryError, Reason
from pd_transfer.layout.geometry import RankGeometry, Role
from pd_transfer.layout.presets import load_preset
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.spans import TokenSpan
from pd_transfer.layout.views import Layout, Pool
from pd_transfer.memory.segments import SEGMENT_DIR, SEGMENT_PREFIX
from pd_transfer.processes.ports import spare_port
from pd_transfer.security.secret import SECRET_ENV, SECRET_FILE_ENV
from pd_transfer.testing import World

_ids = itertools.count()


def sidecar_environ(config: dict) -> dict[str, str]:
    """The environment of a sidecar process: this one's, which names the run's shared
    secret (tests/conftest.py, or :func:`use_ephemeral_secret`), unless ``config``
    chooses its own security (``secret_file``, ``allow_insecure``): variables override
    the file, so the run's secret is kept from it."""
    if "secret_file" in config or config.get("allow_insecure"):
        return {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
    return dict(os.environ)


@contextlib.contextmanager
def worker_environ(insecure: bool):
    """Where a worker's client is made: without the run's secret next to an insecure sidecar
    (a client holding a secret insists on the handshake)."""
    if not insecure:
        yield
        return
    saved = {k: os.environ.pop(k) for k in (SECRET_ENV, SECRET_FILE_ENV) if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _limit_files(nofile: int) -> None:
    """In a sidecar's process before it runs: at most ``nofile`` descriptors (soft and hard)."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))


class Sidecar:
    def __init__(
        self,
        workdir: Path,
        role: str,
        name: str,
        config: dict,
        bootstrap: str = "",
        worker_scheme: str = "unix",
        nofile: int | None = None,
        prefix: tuple[str, ...] = (),
    ) -> None:
        """``prefix`` runs the sidecar through another command that execs it (``nsenter``
        into a network namespace), so that ``proc`` is still the sidecar."""
        self.name, self.role = name, role
        self.endpoint = f"{worker_scheme}://{workdir}/{name}.sock"
        self.ready = workdir / f"{name}.ready.json"
        self.log = workdir / f"{name}.log"
        config_path = workdir / f"{name}.toml"
        lines = ["[sidecar]"] + [f"{k} = {json.dumps(v)}" for k, v in config.items()]
        config_path.write_text("\n".join(lines) + "\n")
        cmd = [
            *prefix,
            sys.executable,
            "-m",
            "pd_transfer.cli",
            "serve",
            "--role",
            role,
            "--agent-id",
            name,
            "--worker-endpoint",
            self.endpoint,
            "--ready-file",
            str(self.ready),
            "--config",
            str(config_path),
            "--log-level",
            "info",
        ]
        if bootstrap:
            cmd += ["--bootstrap", bootstrap]
        self.proc = subprocess.Popen(
            cmd,
            stderr=self.log.open("w"),
            stdout=subprocess.DEVNULL,
            env=sidecar_environ(config),
            preexec_fn=None if nofile is None else functools.partial(_limit_files, nofile),
        )

    def wait_ready(self, timeout_s: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self.ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready: {self.log.read_text()[-2000:]}")
            time.sleep(0.02)
        return json.loads(self.ready.read_text())

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        self.terminate()
        self.wait_stopped()

    def terminate(self) -> None:
        """SIGTERM (the sidecar drains and exits), without waiting."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self, timeout_s: float = 15.0) -> None:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Cluster:
    """Sidecars + shm pools + clients for the given prefill and decode ranks."""

    def __init__(
        self,
        workdir: Path,
        prefill: list[RankGeometry],
        decode: list[RankGeometry],
        *,
        transport: str = "shm",
        config: dict | None = None,
        seed: int = 0,
        decode_config: dict | None = None,
        attach: bool = True,
        device: str = "cpu",
        decode_device: str | None = None,
        worker_scheme: str = "unix",
        prefill_nofile: int | None = None,
        tag: str = "",
        command_prefix: tuple[str, ...] = (),
    ) -> None:
        self.workdir = workdir
        # "cuda": pools are CUDA tensors shared through CUDA IPC handles
        self.devices = {"prefill": device, "decode": decode_device or device}
        self.prefill, self.decode = prefill, decode
        self.bootstrap = f"tcp://127.0.0.1:{spare_port()}"
        try:
            self.world = World.build(prefill, decode, seed)
        except GeometryError:
            self.world = None  # a pair meant to be rejected: no ground truth to lay out
        self.landed: dict[int, dict] = {}  # room -> requests, for verify_landed
        tag = tag or f"{os.getpid()}-{next(_ids)}"  # in every sidecar's agent id
        base = {
            "transport": transport,
            "http_port": 0,
            "heartbeat_interval_s": 0.2,
            "heartbeat_misses": 5,
            "bootstrap_timeout_s": 10.0,
            "waiting_timeout_s": 20.0,
            "transfer_timeout_s": 20.0,
            "abort_drain_timeout_s": 3.0,
            **(config or {}),
        }
        if transport in ENGINES:  # the engines' own listeners authenticate nobody: accepted here
            base.setdefault("allow_unauthenticated_engine", True)
        self.insecure = bool(base.get("allow_insecure"))  # then workers hold no secret either
        self.sidecars: dict[str, Sidecar] = {}
        for geometry in prefill + decode:
            role = geometry.role.value
            name = f"{role}-pp{geometry.pp_rank}-tp{geometry.tp_rank}-{tag}"
            config_for = base if role == "prefill" else {**base, **(decode_config or {})}
            if role == "decode" and config_for.get("prefill_bootstraps") == "this":
                config_for["prefill_bootstraps"] = [self.bootstrap]
            self.sidecars[geometry.rank_id] = Sidecar(
                workdir,
                role,
                name,
                config_for,
                self.bootstrap if role == "prefill" else "",
                worker_scheme,
                nofile=prefill_nofile if role == "prefill" else None,
                prefix=command_prefix,
            )
        self.pools, self.clients = {}, {}
        self._tag = tag
        try:
            self.ready = {rank: sidecar.wait_ready() for rank, sidecar in self.sidecars.items()}
            if attach:
                self.attach_all()
        except BaseException:
            self.close()
            raise

    def attach_all(self) -> None:
        """Allocate every worker's pools, fill them and register with the sidecars."""
        for geometry in self.prefill + self.decode:
            self._attach(geometry, self._tag)

    def http(self, rank_id: str, path: str) -> tuple[int, str]:
        import urllib.error
        import urllib.request

        url = self.ready[rank_id]["http_address"] + path
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def metric(self, rank_id: str, name: str, **labels) -> float:
        """The sum of ``name``'s samples with ``labels`` in a scrape of ``rank_id``'s /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        status, text = self.http(rank_id, "/metrics")
        assert status == 200
        return sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def _attach(self, geometry: RankGeometry, tag: str) -> None:
        rank = geometry.rank_id
        on_gpu = self.devices[geometry.role.value] == "cuda"
        if on_gpu:
            pools = self.pools[rank] = allocate_cuda_pools(geometry)
        else:
            pools = self.pools[rank] = allocate_pools(
                geometry, f"t{tag}-{geometry.role.value}{geometry.pp_rank}{geometry.tp_rank}"
            )
        if self.world is not None:
            world = (
                self.world.prefill_buffers if geometry.role.value == "prefill" else self.world.decode_buffers
            )[rank]
            for region_id, tensor in pools.tensors.items():
                tensor.copy_(torch.from_numpy(world[region_id]))
            if on_gpu:  # the worker's writes are done before its sidecar reads
                torch.cuda.synchronize()
        with worker_environ(self.insecure):
            client = self.clients[rank] = Client(self.sidecars[rank].endpoint, rank, timeout_s=20)
        stages = self.prefill if geometry.role is Role.PREFILL else self.decode
        client.register(geometry, pools.handles, pp_size=1 + max(g.pp_rank for g in stages))

    # -- driving rooms ------------------------------------------------------------
    def expect(self, room: int, requests: dict) -> None:
        for geometry in self.decode:  # each worker names the pools its rank registers, no other
            dst = {pool: _sides(r)[1] for pool, r in requests.items() if pool in geometry.pools()}
            self.clients[geometry.rank_id].expect(
                room,
                self.bootstrap,
                dst.get(Pool.KV, []),
                state_slots=dst.get(Pool.MAMBA, []),
                aux_row=int(dst[Pool.AUX][0]) if Pool.AUX in dst else None,
                swa_pages=dst.get(Pool.SWA, []),
            )

    def send(self, room: int, requests: dict, chunk_pages: int = 0) -> None:
        every = {pool: _sides(request)[0] for pool, request in requests.items()}
        for geometry in self.prefill:  # each worker names the pools its rank registers, no other
            src = {pool: indices for pool, indices in every.items() if pool in geometry.pools()}
            pages = list(src.get(Pool.KV, []))
            chunks = [pages[i : i + chunk_pages] for i in range(0, len(pages), chunk_pages or 1)]
            if not chunk_pages or not chunks:  # one chunk; a stage with no kv layer sends none
                chunks = [pages]
            client = self.clients[geometry.rank_id]
            for chunk in chunks[:-1]:
                client.send(room, chunk, last_chunk=False)
            client.send(
                room,
                chunks[-1],
                state_slots=src.get(Pool.MAMBA, []),
                aux_row=int(src[Pool.AUX][0]) if Pool.AUX in src else None,
                swa_pages=src.get(Pool.SWA, []),
            )

    def wait_decode(self, room: int, timeout_s: float = 30.0) -> dict:
        return {g.rank_id: self.clients[g.rank_id].wait(room, timeout_s) for g in self.decode}

    def verify(self, requests: dict) -> list[str]:
        for geometry in self.decode:
            world = self.world.decode_buffers[geometry.rank_id]
            for region_id, tensor in self.pools[geometry.rank_id].tensors.items():
                world[region_id][:] = tensor.cpu().numpy()
        return self.world.verify(requests)

    def verify_landed(self, room: int, requests: dict) -> list[str]:
        """Like :meth:`verify`, for ``room`` and every room checked this way before it.

        Tests that share one cluster then check every byte landed so far, whatever
        order they run in (their rooms' destinations must be disjoint)."""
        self.landed[room] = requests
        return self.verify(list(self.landed.values()))

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        for sidecar in self.sidecars.values():  # all at once: each drains on its own
            sidecar.terminate()
        for sidecar in self.sidecars.values():
            sidecar.wait_stopped()
        for pools in self.pools.values():
            pools.close()
        for sidecar in self.sidecars.values():  # a killed decode sidecar leaves its doorbells
            for path in Path(SEGMENT_DIR).glob(f"{SEGMENT_PREFIX}{sidecar.name}-doorbells-*"):
                path.unlink(missing_ok=True)

    def logs(self) -> str:
        return "\n".join(f"== {s.name}\n{s.log.read_text()[-3000:]}" for s in self.sidecars.values())


def _sides(request) -> tuple:
    """``(src, dst)`` indices of a pool's request: a pair, or a TokenSpan's page lists."""
    if isinstance(request, TokenSpan):
        return request.src_pages, request.dst_pages
    return request


def poll_known(client, room: int):
    """``client.poll(room)``, or None while the sidecar does not know ``room`` yet (the
    request that makes it is still on its way, over another socket)."""
    try:
        return client.poll(room)
    except Refused as err:
        if err.code is Reason.UNKNOWN_ROOM:
            return None
        raise


def small_instances(model: str, tp_src: int, tp_dst: int, layout: Layout = Layout.NHD):
    """A prefill (NHD) and a decode instance of a preset with small pools (6 pages, 2 slots)."""
    spec = load_preset(model)
    common = dict(page_size=16, num_pages=6, num_slots=2, num_aux_rows=2)
    return (
        build_instance(spec, Role.PREFILL, tp_src, kv_layout=Layout.NHD, **common),
        build_instance(spec, Role.DECODE, tp_dst, kv_layout=layout, **common),
    )


def random_requests(prefill, decode, rng: np.random.Generator, pages: int) -> dict:
    requests = {}
    for pool in Pool:
        src = [v.index_count for g in prefill for v in g.views if v.pool is pool]
        dst = [v.index_count for g in decode for v in g.views if v.pool is pool]
        if not src or not dst:
            continue
        n = 1 if pool in (Pool.MAMBA, Pool.AUX) else min(pages, min(src), min(dst))
        if pool is Pool.SWA:
            n = min(n, 3)
        requests[pool] = (rng.choice(min(src), n, replace=False), rng.choice(min(dst), n, replace=False))
    return requests
