"""deploy/systemd/pd-transfer@.service: restarts on failure but never on a bad config,
drains on SIGTERM, and its hardening keeps /dev/shm shared with the worker."""

import re

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
    assert service["RemoveIPC"] == ["no"]          # would delete the worker's pools on stop
    assert service.get("DynamicUser", ["no"])[-1] == "no"    # implies RemoveIPC=yes
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
