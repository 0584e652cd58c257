"""deploy/systemd/pd-transfer@.service: restarts on failure but never on a bad config,
drains on SIGTERM, and its hardening keeps /dev/shm shared with the worker."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deploy_files import SYSTEMD_UNIT


def _parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"not a unit line: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


@pytest.fixture(scope="module")
def unit():
    return _parse_unit(SYSTEMD_UNIT.read_text())


def _seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)\s*(s|min)?", value)
    assert match, value
    return int(match.group(1)) * (60 if match.group(2) == "min" else 1)


def test_unit_has_its_sections(unit):
    assert {"Unit", "Service", "Install"} <= set(unit)
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_exec_start_serves_the_instances_config(unit):
    (exec_start,) = unit["Service"]["ExecStart"]
    assert " serve " in exec_start
    assert "--config /etc/pd-transfer/%i.toml" in exec_start


def test_restarts_on_failure_but_not_on_an_invalid_config(unit):
    service = unit["Service"]
    assert service["Restart"] == ["on-failure"]
    assert "2" in service["RestartPreventExitStatus"][-1].split()


def test_sigterm_drains_within_the_stop_timeout(unit):
    service = unit["Service"]
    assert service["KillSignal"] == ["SIGTERM"]
    assert _seconds(service["TimeoutStopSec"][-1]) >= 10


def test_hardening_keeps_dev_shm_shared(unit):
    service = unit["Service"]
    assert service["RemoveIPC"] == ["no"]  # would delete the worker's pools on stop
    assert service.get("DynamicUser", ["no"])[-1] == "no"  # implies RemoveIPC=yes
    assert service.get("PrivateDevices", ["no"])[-1] == "no"
    assert "/dev/shm" in service["ReadWritePaths"][-1].split()
    for key in ("InaccessiblePaths", "ReadOnlyPaths", "TemporaryFileSystem"):
        for value in service.get(key, []):
            assert "/dev" not in value, (key, value)
    assert service["NoNewPrivileges"] == ["yes"]
    assert service["ProtectSystem"] == ["strict"]


def test_runtime_directory_is_per_instance(unit):
    # a shared RuntimeDirectory would be removed with the first instance that stops
    assert unit["Service"]["RuntimeDirectory"] == ["pd-transfer/%i"]


def _documented_venv() -> str:
    (venv,) = re.findall(
        r"^#\s+python3 -m venv (\S+) && \1/bin/pip install .* \.$", SYSTEMD_UNIT.read_text(), re.M
    )
    return venv


def test_exec_start_runs_what_the_documented_install_makes(unit):
    (exec_start,) = unit["Service"]["ExecStart"]
    assert exec_start.split()[0] == f"{_documented_venv()}/bin/pd-transfer"
    # the user the unit runs as is the one the install creates
    (user,) = unit["Service"]["User"]
    assert re.search(rf"^#\s+useradd --system .*\b{user}$", SYSTEMD_UNIT.read_text(), re.M)


def test_the_unit_names_no_placeholder_url():
    assert "example" not in SYSTEMD_UNIT.read_text()


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed (Debian's systemd package)",
)
def test_systemd_analyze_verify_passes(tmp_path):
    # systemd-analyze checks that ExecStart's program exists: point it at this environment's
    # pd-transfer (the README's install), everything else as shipped
    program = Path(sys.executable).parent / "pd-transfer"
    if not program.exists():
        pytest.skip(f"{program} is not installed")
    copy = tmp_path / SYSTEMD_UNIT.name
    copy.write_text(SYSTEMD_UNIT.read_text().replace(f"{_documented_venv()}/bin/pd-transfer", str(program)))
    result = subprocess.run(
        ["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=120
    )
    # verify exits 0 on warnings too ("Unknown key ..., ignoring"): none may name the unit
    said = [line for line in (result.stdout + result.stderr).splitlines() if "pd-transfer@" in line]
    assert result.returncode == 0 and said == [], result.stdout + result.stderr


def test_the_shared_secret_is_a_credential_the_sidecar_reads(unit):
    service = unit["Service"]
    (credential,) = [c for c in service["LoadCredential"] if c.startswith("secret:")]
    assert credential.split(":", 1)[1].startswith("/etc/pd-transfer/")
    assert "PD_TRANSFER_SECRET_FILE=%d/secret" in service["Environment"]
    assert not any("ALLOW_INSECURE" in e for e in service["Environment"])
    assert "--insecure" not in service["ExecStart"][-1]
