"""``pd-transfer serve`` on first use, outside systemd: what an operator met, by hand.

The shipped sidecar configs put the worker socket and the ready file in
``/run/pd-transfer/gpuN/``, which only systemd made; two sidecars with the default
``http_port`` on one host collided without the error naming ``http_port``; a stopped
sidecar left its ready file behind. Each test runs the real command.
"""

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pd_transfer.processes.ports import spare_port

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "configs" / "sidecars"
RUN_DIR = "/run/pd-transfer/"


def _environ(extra: dict[str, str]) -> dict[str, str]:
    # the session's shared secret stays: the sidecars refuse to start without one
    kept = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PD_TRANSFER_") or k == "PD_TRANSFER_SECRET_FILE"
    }
    return {**kept, **extra}


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pd_transfer.cli", "serve", *args],
        env=_environ(env),
        stderr=log.open("w"),
        stdout=subprocess.DEVNULL,
    )


def _wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"exited {proc.returncode}: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"not ready: {log.read_text()[-2000:]}"
        time.sleep(0.05)
    return json.loads(path.read_text())


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _shipped_copy(name: str, tmp_path: Path) -> tuple[Path, Path]:
    """The shipped config, its /run/pd-transfer/ paths moved under tmp_path (not yet made)."""
    run = tmp_path / "run" / "pd-transfer"
    text = (SHIPPED / name).read_text()
    assert RUN_DIR in text, f"{name} no longer uses {RUN_DIR}: update this test"
    config = tmp_path / name
    config.write_text(text.replace(RUN_DIR, f"{run}/"))
    return config, run


@pytest.mark.parametrize("name", ["llama-3.1-8b.prefill.toml", "llama-3.1-8b.decode.toml"])
def test_a_shipped_config_serves_outside_systemd_and_cleans_up_on_stop(tmp_path, name):
    config, run = _shipped_copy(name, tmp_path)
    log = tmp_path / "sidecar.log"
    # the file's fixed ports could be taken on a shared test host; everything else is the file's
    ports = {
        "PD_TRANSFER_HTTP_PORT": str(spare_port()),
        "PD_TRANSFER_HTTP_HOST": "127.0.0.1",
        "PD_TRANSFER_CONTROL_PORT": str(spare_port()),
        "PD_TRANSFER_DATA_PORT": str(spare_port()),
        "PD_TRANSFER_PREFILL_BOOTSTRAPS": "",
    }  # no prefill instance to resolve here
    proc = _start(["--config", str(config)], ports, log)
    instance = run / ("gpu0" if "prefill" in name else "gpu4")
    try:
        ready = _wait_for(instance / "ready.json", proc, log)
        assert ready["worker_endpoint"] == f"unix://{instance}/worker.sock"
        assert stat.S_IMODE(instance.stat().st_mode) == 0o700
        assert stat.S_ISSOCK((instance / "worker.sock").stat().st_mode)
        with urllib.request.urlopen(ready["http_address"] + "/healthz", timeout=5) as response:
            assert response.status == 200
    finally:
        code = _stop(proc)
    assert code == 0, log.read_text()[-2000:]
    assert sorted(p.name for p in instance.iterdir()) == [], "ready.json or the socket left behind"


def test_an_uncreatable_socket_directory_says_what_to_create(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    socket_dir = blocker / "gpu0"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pd_transfer.cli",
            "serve",
            "--role",
            "prefill",
            "--http-port",
            "0",
            "--worker-endpoint",
            f"unix://{socket_dir}/worker.sock",
        ],
        env=_environ({}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 3, result.stderr
    assert f"worker_endpoint: cannot create the directory {socket_dir}" in result.stderr
    assert "install -d -m 0700 -o " in result.stderr and f" {socket_dir})" in result.stderr


def test_two_sidecars_on_one_http_port_the_second_names_http_port(tmp_path):
    # the default config's http_port for both roles, as on a host where both run with it
    same = {"PD_TRANSFER_HTTP_PORT": str(spare_port())}
    first_log, second_log = tmp_path / "prefill.log", tmp_path / "decode.log"
    first = _start(
        [
            "--role",
            "prefill",
            "--worker-endpoint",
            f"unix://{tmp_path}/p.sock",
            "--ready-file",
            str(tmp_path / "p.json"),
        ],
        same,
        first_log,
    )
    try:
        _wait_for(tmp_path / "p.json", first, first_log)
        second = _start(
            ["--role", "decode", "--worker-endpoint", f"unix://{tmp_path}/d.sock"], same, second_log
        )
        assert second.wait(timeout=60) == 3
    finally:
        _stop(first)
    text = second_log.read_text()
    port = same["PD_TRANSFER_HTTP_PORT"]
    assert f"http_port {port}: cannot bind 127.0.0.1:{port}: in use by another process" in text
    assert "its own http_port (--http-port or PD_TRANSFER_HTTP_PORT)" in text


def test_a_busy_control_port_names_control_port(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pd_transfer.cli",
                "serve",
                "--role",
                "prefill",
                "--control-port",
                str(port),
                "--http-port",
                "0",
                "--worker-endpoint",
                f"unix://{tmp_path}/w.sock",
            ],
            env=_environ({}),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 3
    assert f"control_port {port}: cannot bind 127.0.0.1:{port}: in use" in result.stderr


def test_the_ready_file_is_removed_on_a_clean_stop(tmp_path):
    ready, log = tmp_path / "ready.json", tmp_path / "sidecar.log"
    proc = _start(
        [
            "--role",
            "decode",
            "--http-port",
            "0",
            "--ready-file",
            str(ready),
            "--worker-endpoint",
            f"unix://{tmp_path}/w.sock",
        ],
        {},
        log,
    )
    try:
        _wait_for(ready, proc, log)
    finally:
        code = _stop(proc)
    assert code == 0, log.read_text()[-2000:]
    assert not ready.exists()
