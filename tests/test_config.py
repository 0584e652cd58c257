"""Sidecar configuration: flags > PD_TRANSFER_* > file > defaults; every bad field reported."""

import pytest

from pd_transfer.config import load_sidecar_config, render_toml
from pd_transfer.errors import ConfigError
from pd_transfer.layout.geometry import Role


def _file(tmp_path, text):
    path = tmp_path / "sidecar.toml"
    path.write_text("[sidecar]\n" + text)
    return str(path)


def test_precedence_is_flags_then_environment_then_file_then_defaults(tmp_path):
    path = _file(tmp_path, 'role = "prefill"\ncontrol_port = 1000\ndata_port = 1001\nhttp_port = 1002\n')
    env = {"PD_TRANSFER_DATA_PORT": "2001", "PD_TRANSFER_HTTP_PORT": "2002", "OTHER": "x"}
    config = load_sidecar_config(path, {"http_port": 3002, "data_port": None}, env)
    assert config.role is Role.PREFILL
    assert config.control_port == 1000       # file
    assert config.data_port == 2001          # environment beats file
    assert config.http_port == 3002          # flag beats environment
    assert config.heartbeat_misses == 4      # default


def test_environment_lists_are_comma_separated(tmp_path):
    env = {"PD_TRANSFER_ROLE": "decode",
           "PD_TRANSFER_PREFILL_BOOTSTRAPS": "tcp://10.0.0.1:8998, tcp://10.0.0.2:8998"}
    config = load_sidecar_config(None, {}, env)
    assert config.prefill_bootstraps == ("tcp://10.0.0.1:8998", "tcp://10.0.0.2:8998")


def test_every_bad_field_is_reported_at_once_with_its_path_and_accepted_values(tmp_path):
    path = _file(tmp_path, 'role = "middle"\ntransport = "ib"\nheartbeat_misses = 0\ncolour = 1\n')
    with pytest.raises(ConfigError) as err:
        load_sidecar_config(path, {}, {"PD_TRANSFER_CONTROL_PORT": "eighty"})
    text = str(err.value)
    assert "5 problem(s)" in text
    assert "sidecar.role: 'middle' is not one of ['prefill', 'decode']" in text
    assert "sidecar.transport: 'ib' is not one of ['auto', 'shm', 'tcp']" in text
    assert "sidecar.heartbeat_misses: must be positive, got 0" in text
    assert "sidecar.control_port: expected int, got 'eighty'" in text
    assert "unknown key(s) ['colour']" in text


def test_print_config_round_trips(tmp_path):
    config = load_sidecar_config(None, {"role": "decode", "prefill_bootstraps": ["tcp://h:1"]}, {})
    path = tmp_path / "printed.toml"
    path.write_text(render_toml(config))
    assert load_sidecar_config(str(path), {}, {}) == config
