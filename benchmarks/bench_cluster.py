"""Sidecar deployments for the end-to-end benchmarks: one prefill instance, N decode instances.

Every sidecar is a real ``pd-transfer serve`` process on loopback; the
workers are played by the benchmark process through the real client library
(sync for set-up, asyncio for concurrent rooms), with pools in real shared
memory filled with a constant (throughput benchmarks; byte-exact checks are
the tests' and the demo's job).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from pd_transfer.client import AsyncClient, Client, allocate_pools
from pd_transfer.layout.geometry import RankGeometry, Role
from pd_transfer.layout.presets import load_preset
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import Layout
from pd_transfer.processes.ports import spare_port
from pd_transfer.security.secret import use_ephemeral_secret

PAGE = 16


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set (VmHWM; shared-memory pages it touched included)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class Cluster:
    """A prefill instance of TP ``tp_src`` and ``num_decode`` decode instances of TP ``tp_dst``."""

    def __init__(
        self,
        workdir: Path,
        *,
        model: str = "llama-3.1-8b",
        tp_src: int = 1,
        tp_dst: int = 1,
        num_decode: int = 1,
        num_pages: int = 256,
        transport: str = "shm",
        extra_args: tuple[str, ...] = (),
        fill: int = 7,
    ) -> None:
        spec = load_preset(model)
        shape = {
            "page_size": PAGE,
            "num_pages": num_pages,
            "kv_layout": Layout.NHD,
            "num_aux_rows": 64,
            "num_slots": 64,
        }
        self.prefill = build_instance(spec, Role.PREFILL, tp_src, **shape)
        self.decodes = [build_instance(spec, Role.DECODE, tp_dst, **shape) for _ in range(num_decode)]
        self.bootstrap = f"tcp://127.0.0.1:{spare_port()}"
        self.workdir = workdir
        use_ephemeral_secret(workdir)  # sidecars and clients authenticate, as deployed
        self.procs: dict[str, subprocess.Popen] = {}
        self.clients: dict[str, Client] = {}
        self.endpoints: dict[str, str] = {}
        self.pools = []
        ranks = [("p", g) for g in self.prefill] + [
            (f"d{i}", g) for i, instance in enumerate(self.decodes) for g in instance
        ]
        for tag, geometry in ranks:
            self._spawn(f"{tag}-tp{geometry.tp_rank}", geometry, transport, extra_args)
        for tag, geometry in ranks:
            self._attach(f"{tag}-tp{geometry.tp_rank}", geometry, fill)

    def _spawn(self, name: str, geometry: RankGeometry, transport: str, extra_args: tuple[str, ...]) -> None:
        endpoint = f"unix://{self.workdir}/{name}.sock"
        cmd = [
            sys.executable,
            "-m",
            "pd_transfer.cli",
            "serve",
            "--role",
            geometry.role.value,
            "--agent-id",
            name,
            "--worker-endpoint",
            endpoint,
            "--transport",
            transport,
            "--ready-file",
            str(self.workdir / f"{name}.json"),
            "--http-port",
            "0",
            "--log-level",
            "warning",
            *extra_args,
        ]
        if geometry.role is Role.PREFILL:
            cmd += ["--bootstrap", self.bootstrap]
        self.procs[name] = subprocess.Popen(cmd)
        self.endpoints[name] = endpoint

    def _attach(self, name: str, geometry: RankGeometry, fill: int) -> None:
        ready = self.workdir / f"{name}.json"
        deadline = time.monotonic() + 60
        while not ready.exists():
            if self.procs[name].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sidecar {name} did not start")
            time.sleep(0.02)
        pools = allocate_pools(geometry, f"bench-{self.workdir.name}-{name}")
        self.pools.append(pools)
        for array in pools.arrays.values():
            array[:] = fill
        client = Client(self.endpoints[name], name, timeout_s=60)
        client.register(geometry, pools.handles)
        self.clients[name] = client

    def names(self, role: str, instance: int = 0) -> list[str]:
        """Sidecar names of the prefill instance (``role='p'``) or decode instance ``instance``."""
        tag = "p" if role == "p" else f"d{instance}"
        return [n for n in self.procs if n.startswith(f"{tag}-")]

    def async_clients(self) -> dict[str, AsyncClient]:
        """Fresh asyncio clients (one per sidecar) for the running event loop."""
        return {
            name: AsyncClient(endpoint, f"{name}-async", timeout_s=120)
            for name, endpoint in self.endpoints.items()
        }

    def peak_rss(self) -> dict[str, float]:
        return {name: peak_rss_mib(proc.pid) for name, proc in self.procs.items()}

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for pools in self.pools:
            pools.close()
