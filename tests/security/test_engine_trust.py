"""The engine transports' own listeners authenticate nobody: a sidecar starts one only when
its config accepts that by name, and then says so in its log, ``/status``, ``/readyz``
and the ``pd_transfer_unauthenticated_engine`` gauge.

What is accepted is measured here, not assumed: a process that holds no secret reads a
registered pool of an accepted Mooncake engine's decode sidecar, byte-exact against the
worker's own memory, and writes into it, through the engine's port alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from cluster import Cluster

from pd_transfer.cli import EXIT_INVALID
from pd_transfer.commands.status_view import render_status
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.presets import load_preset
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import Layout
from pd_transfer.observability.listeners import listening
from pd_transfer.security.secret import SECRET_ENV, SECRET_FILE_ENV
from pd_transfer.transport.engines.registry import engine_unusable


def _engine(name: str):
    return pytest.param(
        name, marks=pytest.mark.skipif(bool(engine_unusable(name)), reason=engine_unusable(name) or "-")
    )


ENGINES = [_engine("mooncake"), _engine("nixl")]


def _serve(tmp_path, *args, environ: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pd_transfer.cli",
            "serve",
            "--role",
            "decode",
            "--http-port",
            "0",
            "--worker-endpoint",
            f"unix://{tmp_path}/w.sock",
            "--ready-file",
            str(tmp_path / "ready"),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(environ or {})},
    )


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _wait_ready(tmp_path, proc) -> dict:
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "not ready"
        time.sleep(0.05)
    return json.loads((tmp_path / "ready").read_text())


@pytest.mark.parametrize("engine", ENGINES)
def test_an_engine_transport_does_not_start_unless_its_trust_model_is_accepted(tmp_path, engine):
    proc = _serve(tmp_path, "--transport", engine)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INVALID
    (line,) = [line for line in err.splitlines() if line.startswith("pd-transfer: error:")]
    assert f'transport = "{engine}" needs allow_unauthenticated_engine = true' in line
    assert "--allow-unauthenticated-engine" in line and "PD_TRANSFER_ALLOW_UNAUTHENTICATED_ENGINE=1" in line
    assert "read" in line and "overwrite" in line and "transport tcp" in line  # the risk, and the fix
    assert not (tmp_path / "ready").exists()


@pytest.mark.parametrize("engine", ENGINES)
def test_an_accepted_engine_says_so_in_log_status_readyz_and_metrics(tmp_path, engine):
    # the variable here; --allow-unauthenticated-engine in the clusters of the other tests
    proc = _serve(tmp_path, "--transport", engine, environ={"PD_TRANSFER_ALLOW_UNAUTHENTICATED_ENGINE": "1"})
    try:
        ready = _wait_ready(tmp_path, proc)
        status = json.loads(_get(ready["http_address"] + "/status")[1])
        assert status["unauthenticated_engine"] == engine and status["insecure"] is False
        measured = {str(s) for s in listening(proc.pid)}
        assert status["engine_listeners"] and set(status["engine_listeners"]) <= measured
        code, body = _get(ready["http_address"] + "/readyz")
        assert code == 503 and json.loads(body)["unauthenticated_engine"] == engine  # no worker yet
        metrics = _get(ready["http_address"] + "/metrics")[1]
        assert 'pd_transfer_unauthenticated_engine{role="decode"} 1.0' in metrics
        shown = render_status(status)
        assert f"UNAUTHENTICATED ENGINE (allow_unauthenticated_engine): the {engine} engine" in shown
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    (warning,) = [line for line in err.splitlines() if "UNAUTHENTICATED ENGINE" in line]
    assert "level=warning" in warning
    assert all(listener in warning for listener in status["engine_listeners"])


_STRANGER = """
import sys
import numpy as np
from mooncake.engine import TransferEngine

session, remote, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engine = TransferEngine()
assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
local = np.zeros(nbytes, np.uint8)
assert engine.register_memory(local.ctypes.data, nbytes) == 0
read = engine.batch_transfer_sync_read(session, [local.ctypes.data], [remote], [nbytes])
print("read", read, local.tobytes().hex(), flush=True)
local[:] = 0xA5
wrote = engine.batch_transfer_sync_write(session, [local.ctypes.data], [remote], [nbytes])
print("wrote", wrote, flush=True)
"""


def _mapped_at(pid: int, path: str) -> int:
    """Where process ``pid`` maps the file ``path`` (its first mapping)."""
    with open(f"/proc/{pid}/maps") as handle:
        for line in handle:
            if line.rstrip().endswith(path):
                return int(line.split("-", 1)[0], 16)
    raise AssertionError(f"{path} is not mapped by {pid}")


@pytest.mark.parametrize("engine", [_engine("mooncake")])
def test_a_stranger_without_the_secret_reads_and_writes_an_accepted_mooncake_pool(workdir, engine):
    spec = load_preset("llama-3.1-8b")
    common = dict(page_size=16, num_pages=4, num_slots=2, num_aux_rows=2, kv_layout=Layout.NHD)
    prefill = build_instance(spec, Role.PREFILL, 1, **common)
    decode = build_instance(spec, Role.DECODE, 1, **common)
    cluster = Cluster(workdir, prefill, decode, transport=engine)
    try:
        rank = decode[0].rank_id
        pools = cluster.pools[rank]
        region, segment = next(iter(pools.segments.items()))
        worker_view = pools.arrays[region]  # the worker's own memory: the oracle
        worker_view[:4096] = np.random.default_rng(9).integers(0, 256, 4096, dtype=np.uint8)
        written_by_worker = worker_view[:4096].copy()
        sidecar = cluster.sidecars[rank]
        status = json.loads(cluster.http(rank, "/status")[1])
        rpc_ports = [int(a.rsplit(":", 1)[1]) for a in status["engine_listeners"] if a.startswith("0.0.0.0:")]
        # a stranger off the host would take the address from the segment description the RPC
        # port serves; here it is read from where the sidecar maps the worker's segment
        remote = _mapped_at(sidecar.proc.pid, segment.path)
        environ = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
        out = subprocess.run(
            [sys.executable, "-c", _STRANGER, f"127.0.0.1:{rpc_ports[0]}", str(remote), "4096"],
            capture_output=True,
            text=True,
            timeout=120,
            env=environ,
        )
        lines = dict(
            line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("read", "wrote"))
        )
        assert lines["read"].split()[0] == "0", out.stderr[-2000:]
        assert bytes.fromhex(lines["read"].split()[1]) == written_by_worker.tobytes()
        assert lines["wrote"].strip() == "0" and (worker_view[:4096] == 0xA5).all()
    finally:
        cluster.close()
