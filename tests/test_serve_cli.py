"""``pd-transfer serve``: a bad config is one clear error and exit 2; a busy port exit 3."""

import socket
import subprocess
import sys


def _serve(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "pd_transfer.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_invalid_config_names_every_bad_field_and_exits_2(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text(
        '[sidecar]\nrole = "prefill"\ntransport = "carrier-pigeon"\nheartbeat_interval_s = -1\nbogus = 1\n'
    )
    result = _serve("--config", str(config))
    assert result.returncode == 2
    assert (
        "sidecar.transport: 'carrier-pigeon' is not one of ['auto', 'shm', 'tcp', 'mooncake', 'nixl']"
    ) in result.stderr
    assert "sidecar.heartbeat_interval_s: must be positive, got -1" in result.stderr
    assert "unknown key(s) ['bogus']" in result.stderr


def test_missing_role_is_reported(tmp_path):
    result = _serve()
    assert result.returncode == 2
    assert "sidecar.role: required (prefill or decode)" in result.stderr


def test_port_in_use_exits_3(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = _serve(
            "--role",
            "prefill",
            "--control-port",
            str(port),
            "--http-port",
            "0",
            "--worker-endpoint",
            f"ipc://{tmp_path}/w.sock",
        )
    assert result.returncode == 3
    assert "cannot start the prefill sidecar" in result.stderr
