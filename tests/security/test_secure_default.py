"""Authentication is on unless a sidecar is told otherwise: without a secret ``pd-transfer
serve`` stops at once with one line naming the fix; ``--insecure`` starts it and it says
so in its log, ``/status``, ``/readyz`` and the ``pd_transfer_insecure`` gauge."""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from pd_transfer.cli import EXIT_INVALID


def _serve(tmp_path, *args) -> subprocess.Popen:
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
    )


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_a_sidecar_without_a_secret_does_not_start_and_says_how_to_fix_it(tmp_path, no_secret):
    proc = _serve(tmp_path)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INVALID
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "no shared secret" in lines[0]
    assert "pd-transfer keygen" in lines[0] and "allow_insecure = true" in lines[0]
    assert "--insecure" in lines[0]
    assert not (tmp_path / "ready").exists()


def test_keygen_makes_the_secret_that_lets_it_start(tmp_path, no_secret):
    keys = tmp_path / "keys"
    assert (
        subprocess.run(
            [sys.executable, "-m", "pd_transfer.cli", "keygen", "--out", str(keys)],
            capture_output=True,
            timeout=60,
        ).returncode
        == 0
    )
    config = tmp_path / "sidecar.toml"
    config.write_text(f'[sidecar]\nsecret_file = "{keys / "secret"}"\n')
    proc = _serve(tmp_path, "--config", str(config))
    try:
        ready = _wait_ready(tmp_path, proc)
        assert json.loads(_get(ready["http_address"] + "/status")[1])["insecure"] is False
        assert _gauge(ready) == 0
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "shared-secret authentication on" in err and "INSECURE" not in err


def _wait_ready(tmp_path, proc) -> dict:
    deadline = time.monotonic() + 30
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "not ready"
        time.sleep(0.05)
    return json.loads((tmp_path / "ready").read_text())


def _gauge(ready: dict) -> float:
    text = _get(ready["http_address"] + "/metrics")[1]
    (value,) = [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "pd_transfer_insecure"
    ]
    return value


def test_an_insecure_sidecar_says_so_in_log_status_readyz_and_metrics(tmp_path, no_secret):
    proc = _serve(tmp_path, "--insecure")
    try:
        ready = _wait_ready(tmp_path, proc)
        status = json.loads(_get(ready["http_address"] + "/status")[1])
        assert status["insecure"] is True
        code, body = _get(ready["http_address"] + "/readyz")
        assert code == 503 and json.loads(body)["insecure"] is True  # no worker yet: not ready
        assert _gauge(ready) == 1
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    (warning,) = [line for line in err.splitlines() if "INSECURE" in line]
    assert "level=warning" in warning and "authentication OFF" in warning


def test_the_status_command_shows_an_insecure_sidecar(tmp_path, no_secret):
    from pd_transfer.commands.status_view import render_status

    proc = _serve(tmp_path, "--insecure")
    try:
        ready = _wait_ready(tmp_path, proc)
        text = render_status(json.loads(_get(ready["http_address"] + "/status")[1]))
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert "security: INSECURE" in text


def test_allow_insecure_also_comes_from_the_environment(tmp_path, no_secret, monkeypatch):
    monkeypatch.setenv("PD_TRANSFER_ALLOW_INSECURE", "true")
    proc = _serve(tmp_path)
    try:
        ready = _wait_ready(tmp_path, proc)
        assert _gauge(ready) == 1
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
