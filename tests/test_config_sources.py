"""Every setting a sidecar is given is applied or refused with where it came from.

What an operator met: a misnamed table (``[sidecars]``) or keys above ``[sidecar]``
ignored without a word, so with ``--role`` on the command line (as the Kubernetes
manifests pass it) the sidecar served on defaults; a ``PD_TRANSFER_*`` typo ignored; a
bad variable blamed on ``<flags>``; ``bootstrap = "localhost:8998"`` accepted. These run
``pd-transfer serve`` as a process and read what it prints and serves.
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from pd_transfer.config.sidecar import load_sidecar_config
from pd_transfer.config.sources import SERVICE_LINK
from pd_transfer.errors import ConfigError
from pd_transfer.processes.ports import spare_port


def _serve(*args, env=None, timeout=60):
    # the session's shared secret stays: the sidecars refuse to start without one
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PD_TRANSFER_") or k == "PD_TRANSFER_SECRET_FILE"
    }
    return subprocess.run(
        [sys.executable, "-m", "pd_transfer.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**environ, **(env or {})},
    )


def _problems(text: str) -> list[str]:
    return [line.removeprefix("  - ") for line in text.splitlines() if line.startswith("  - ")]


def test_a_misnamed_table_and_keys_above_sidecar_stop_serve_with_their_paths(tmp_path):
    # the operator's file: allow_insecure and the port above the table, the rest in [sidecars]
    config = tmp_path / "sidecar.toml"
    config.write_text(
        f"allow_insecure = true\nhttp_port = {spare_port()}\n\n"
        '[sidecars]\nrole = "prefill"\nheartbeat_misses = 8\n'
    )
    result = _serve(
        "--role",
        "prefill",
        "--config",
        str(config),
        "--http-port",
        "0",
        "--worker-endpoint",
        f"unix://{tmp_path}/w.sock",
        timeout=30,
    )
    assert result.returncode == 2, result.stderr
    assert _problems(result.stderr) == [
        f"{config}: allow_insecure: above the [sidecar] line, so in no table: move it below that line",
        f"{config}: http_port: above the [sidecar] line, so in no table: move it below that line",
        f"{config}: [sidecars]: unknown table, so nothing in it would be applied "
        "(did you mean [sidecar]?): the sidecar reads only [sidecar]",
    ]


def test_an_unknown_key_outside_any_table_is_refused(tmp_path):
    config = tmp_path / "sidecar.toml"
    config.write_text('colour = "blue"\n[sidecar]\nrole = "decode"\n')
    with pytest.raises(ConfigError) as err:
        load_sidecar_config(str(config), {}, {})
    assert f"{config}: colour: unknown key outside any table" in str(err.value)


def test_the_files_sidecar_table_applies_with_role_given_as_a_flag(tmp_path):
    config = tmp_path / "sidecar.toml"
    config.write_text("[sidecar]\nallow_insecure = true\nheartbeat_misses = 9\n")
    result = _serve("--role", "decode", "--config", str(config), "--print-config")
    assert result.returncode == 0, result.stderr
    assert "allow_insecure = true\n" in result.stdout and "heartbeat_misses = 9\n" in result.stdout


def test_an_unknown_pd_transfer_variable_stops_serve_naming_it_and_the_setting_meant(tmp_path):
    result = _serve(
        "--role",
        "prefill",
        "--http-port",
        "0",
        "--worker-endpoint",
        f"unix://{tmp_path}/w.sock",
        env={"PD_TRANSFER_ALLOW_INSECURES": "true"},
        timeout=30,
    )
    assert result.returncode == 2, result.stderr
    (problem,) = _problems(result.stderr)
    assert problem.startswith(
        "PD_TRANSFER_ALLOW_INSECURES: not a pd-transfer setting (did you mean PD_TRANSFER_ALLOW_INSECURE?)"
    )


def test_a_bad_variable_value_names_the_variable_not_the_file_or_flags(tmp_path):
    config = tmp_path / "sidecar.toml"
    config.write_text('[sidecar]\nrole = "decode"\n')
    result = _serve(
        "--config", str(config), "--print-config", env={"PD_TRANSFER_HTTP_PORT": "ninety-four hundred"}
    )
    assert result.returncode == 2
    assert _problems(result.stderr) == ["PD_TRANSFER_HTTP_PORT: expected int, got 'ninety-four hundred'"]
    assert "<flags>" not in result.stderr and str(config) not in result.stderr


# what kubelet injects for Services named pd-transfer and pd-transfer-prefill
SERVICE_LINKS = {
    "PD_TRANSFER_SERVICE_HOST": "10.96.0.12",
    "PD_TRANSFER_SERVICE_PORT": "9400",
    "PD_TRANSFER_SERVICE_PORT_METRICS": "9400",
    "PD_TRANSFER_PORT": "tcp://10.96.0.12:9400",
    "PD_TRANSFER_PORT_9400_TCP": "tcp://10.96.0.12:9400",
    "PD_TRANSFER_PORT_9400_TCP_PROTO": "tcp",
    "PD_TRANSFER_PORT_9400_TCP_PORT": "9400",
    "PD_TRANSFER_PORT_9400_TCP_ADDR": "10.96.0.12",
    "PD_TRANSFER_PREFILL_SERVICE_HOST": "10.96.0.13",
    "PD_TRANSFER_PREFILL_SERVICE_PORT": "8998",
    "PD_TRANSFER_PREFILL_SERVICE_PORT_BOOTSTRAP": "8998",
    "PD_TRANSFER_PREFILL_PORT": "tcp://10.96.0.13:8998",
    "PD_TRANSFER_PREFILL_PORT_8998_TCP": "tcp://10.96.0.13:8998",
    "PD_TRANSFER_PREFILL_PORT_8998_TCP_PROTO": "tcp",
    "PD_TRANSFER_PREFILL_PORT_8998_TCP_PORT": "8998",
    "PD_TRANSFER_PREFILL_PORT_8998_TCP_ADDR": "10.96.0.13",
}


def test_service_link_variables_are_left_alone_and_the_settings_beside_them_apply(tmp_path):
    http_port = spare_port()
    ready = tmp_path / "ready.json"
    env = {
        **SERVICE_LINKS,
        "PD_TRANSFER_HTTP_PORT": str(http_port),
        "PD_TRANSFER_READY_FILE": str(ready),
        "PD_TRANSFER_ROLE": "decode",
        "PD_TRANSFER_WORKER_ENDPOINT": f"unix://{tmp_path}/w.sock",
    }
    # the session's shared secret stays: the sidecars refuse to start without one
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PD_TRANSFER_") or k == "PD_TRANSFER_SECRET_FILE"
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "pd_transfer.cli", "serve"],
        env={**environ, **env},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the sidecar did not become ready"
            time.sleep(0.05)
        address = json.loads(ready.read_text())["http_address"]
        assert address == f"http://127.0.0.1:{http_port}"
        with urllib.request.urlopen(address + "/healthz", timeout=5) as response:
            assert response.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_a_port_variable_holding_a_service_link_says_which_service_injected_it():
    with pytest.raises(ConfigError) as err:
        load_sidecar_config(None, {"role": "decode"}, {"PD_TRANSFER_HTTP_PORT": "tcp://10.96.0.14:9400"})
    assert (
        "PD_TRANSFER_HTTP_PORT: 'tcp://10.96.0.14:9400' is a Kubernetes service link of a "
        "Service named pd-transfer-http" in str(err.value)
    )
    assert "enableServiceLinks: false" in str(err.value)


def test_the_service_link_rule_does_not_cover_setting_typos():
    for typo in ("HTTP_PROT", "CONTROLPORT", "ALLOW_INSECURES", "BOOTSTRAPS", "SECRETFILE"):
        assert not SERVICE_LINK.fullmatch(typo), typo
    for link in ("SERVICE_HOST", "PORT", "X_PORT_53_UDP_ADDR", "A_B_SERVICE_PORT_HTTP_METRICS"):
        assert SERVICE_LINK.fullmatch(link), link


def test_variables_other_parts_of_pd_transfer_read_are_accepted():
    config = load_sidecar_config(
        None, {"role": "decode"}, {"PD_TRANSFER_SECRET": "s" * 32, "PD_TRANSFER_NATIVE_COPY": "0"}
    )
    assert config.role.value == "decode"


# -- addresses and ports: one rule per shape, a suggestion where the fix is obvious -----------


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        (
            "bootstrap",
            "localhost:8998",
            "'localhost:8998' has no scheme: did you mean 'tcp://localhost:8998'?",
        ),
        (
            "bootstrap",
            "http://10.0.0.1:8998",
            "is not a http:// address: did you mean 'tcp://10.0.0.1:8998'?",
        ),
        ("bootstrap", "tcp://node-1", "'tcp://node-1' has no port: did you mean 'tcp://node-1:8998'?"),
        ("bootstrap", "tcp://node-1:0", "the port must be 1-65535"),
        ("bootstrap", "tcp://bad host:1", "is not a tcp://HOST:PORT address"),
        (
            "control_host",
            "0.0.0.0:7100",
            "is an address, not a host: did you mean control_host = '0.0.0.0' and control_port = 7100?",
        ),
        ("data_host", "tcp://10.0.0.2", "is an address, not a host: did you mean '10.0.0.2'?"),
        ("http_host", "", "must not be empty"),
        ("worker_endpoint", "/run/pd/w.sock", "did you mean 'unix:///run/pd/w.sock'?"),
        ("worker_endpoint", "tcp://127.0.0.1", "has no port"),
    ],
)
def test_an_address_field_names_the_problem_and_the_value_meant(field, value, says):
    with pytest.raises(ConfigError) as err:
        load_sidecar_config(None, {"role": "prefill", field: value}, {})
    assert f"sidecar.{field}: " in str(err.value) and says in str(err.value)


def test_each_address_of_a_list_is_checked_and_named_by_its_index():
    with pytest.raises(ConfigError) as err:
        load_sidecar_config(
            None, {"role": "decode"}, {"PD_TRANSFER_PREFILL_BOOTSTRAPS": "tcp://p0:8998, p1:8998"}
        )
    assert _problems(str(err.value)) == [
        "PD_TRANSFER_PREFILL_BOOTSTRAPS[1]: 'p1:8998' has no scheme: did you mean 'tcp://p1:8998'?"
    ]


@pytest.mark.parametrize("field", ["control_port", "data_port", "http_port"])
def test_every_port_field_takes_0_to_65535_and_says_so_the_same_way(field):
    assert getattr(load_sidecar_config(None, {"role": "decode", field: 0}, {}), field) == 0
    assert getattr(load_sidecar_config(None, {"role": "decode", field: 65535}, {}), field) == 65535
    for bad in (-1, 65536):
        with pytest.raises(ConfigError) as err:
            load_sidecar_config(None, {"role": "decode", field: bad}, {})
        assert f"sidecar.{field}: must be a port number, 0-65535 (0: any free port), got {bad}" in str(
            err.value
        )


def test_good_addresses_pass(tmp_path):
    config = load_sidecar_config(
        None,
        {
            "role": "decode",
            "bootstrap": "tcp://[::1]:8998",
            "control_host": "::1",
            "data_host": "pd-decode-0.pd-decode-ranks.ns.svc.cluster.local",
            "http_host": "0.0.0.0",
            "prefill_bootstraps": ["tcp://pd-prefill:8998", "tcp://10.0.0.1:8998"],
            "worker_endpoint": "tcp://127.0.0.1:5555",
        },
        {},
    )
    assert config.prefill_bootstraps == ("tcp://pd-prefill:8998", "tcp://10.0.0.1:8998")


def test_a_bad_flag_is_named_as_the_flag(tmp_path):
    result = _serve(
        "--role", "prefill", "--bootstrap", "localhost:8998", "--http-port", "70000", "--print-config"
    )
    assert result.returncode == 2
    assert _problems(result.stderr) == [
        "--bootstrap: 'localhost:8998' has no scheme: did you mean 'tcp://localhost:8998'?",
        "--http-port: must be a port number, 0-65535 (0: any free port), got 70000",
    ]


def test_the_sglang_backends_variables_are_the_ones_the_sidecar_leaves_alone():
    from pd_transfer.config.sources import COMPONENT_VARIABLES
    from pd_transfer.integrations.sglang.settings import BackendSettings

    backend = {f"PD_TRANSFER_SGLANG_{name.upper()}" for name in BackendSettings.__dataclass_fields__}
    assert set(COMPONENT_VARIABLES) == backend
    config = load_sidecar_config(
        None, {"role": "decode"}, {v: "1" for v in backend} | {"PD_TRANSFER_SIGBUS_GUARD": "0"}
    )
    assert config.role.value == "decode"


def test_a_typo_of_an_sglang_backend_variable_is_refused_by_both_readers():
    from pd_transfer.integrations.sglang.settings import BackendSettings

    typo = {"PD_TRANSFER_SGLANG_CALL_TIMEOUT": "20"}
    with pytest.raises(ConfigError) as err:
        load_sidecar_config(None, {"role": "decode"}, typo)
    assert "PD_TRANSFER_SGLANG_CALL_TIMEOUT: not a pd-transfer setting (did you mean " in str(err.value)
    with pytest.raises(ConfigError) as err:
        BackendSettings.from_environ(typo)
    assert str(err.value).startswith(
        "PD_TRANSFER_SGLANG_CALL_TIMEOUT: not a setting of the SGLang backend "
        "(did you mean PD_TRANSFER_SGLANG_CALL_TIMEOUT_S?)"
    )


def test_decode_only_settings_on_a_prefill_are_refused_by_name():
    with pytest.raises(ConfigError) as err:
        load_sidecar_config(
            None,
            {"role": "prefill"},
            {"PD_TRANSFER_PREFILL_BOOTSTRAPS": "tcp://p0:8998", "PD_TRANSFER_INSTANCE_ID": "decode-a"},
        )
    assert _problems(str(err.value)) == [
        "PD_TRANSFER_INSTANCE_ID: a decode setting, which a prefill sidecar does not read: "
        "remove it here, or set it on the decode sidecars",
        "PD_TRANSFER_PREFILL_BOOTSTRAPS: a decode setting, which a prefill sidecar does not read: "
        "remove it here, or set it on the decode sidecars",
    ]
    config = load_sidecar_config(None, {"role": "decode", "instance_id": "decode-a"}, {})
    assert config.instance_id == "decode-a"


def test_print_config_refuses_what_serve_refuses_a_missing_secret(tmp_path):
    config = tmp_path / "sidecar.toml"
    config.write_text('[sidecar]\nrole = "decode"\nsecret_file = ""\n')
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PD_TRANSFER_")}
    result = subprocess.run(
        [sys.executable, "-m", "pd_transfer.cli", "serve", "--config", str(config), "--print-config"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "secret" in result.stderr and "[sidecar]" not in result.stdout
