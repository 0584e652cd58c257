"""Sidecar configuration: flags > PD_TRANSFER_* > file > defaults; every bad field reported."""

import pytest

from pd_transfer.config import extras
from pd_transfer.config.sidecar import load_sidecar_config, render_toml
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
    assert config.control_port == 1000  # file
    assert config.data_port == 2001  # environment beats file
    assert config.http_port == 3002  # flag beats environment
    assert config.heartbeat_misses == 4  # default


def test_environment_lists_are_comma_separated(tmp_path):
    env = {
        "PD_TRANSFER_ROLE": "decode",
        "PD_TRANSFER_PREFILL_BOOTSTRAPS": "tcp://10.0.0.1:8998, tcp://10.0.0.2:8998",
    }
    config = load_sidecar_config(None, {}, env)
    assert config.prefill_bootstraps == ("tcp://10.0.0.1:8998", "tcp://10.0.0.2:8998")


def test_every_bad_field_is_reported_at_once_with_its_path_and_accepted_values(tmp_path):
    path = _file(tmp_path, 'role = "middle"\ntransport = "ib"\nheartbeat_misses = 0\ncolour = 1\n')
    with pytest.raises(ConfigError) as err:
        load_sidecar_config(path, {}, {"PD_TRANSFER_CONTROL_PORT": "eighty"})
    text = str(err.value)
    assert "5 problem(s)" in text
    assert "sidecar.role: 'middle' is not one of ['prefill', 'decode']" in text
    assert "sidecar.transport: 'ib' is not one of ['auto', 'shm', 'tcp', 'mooncake', 'nixl']" in text
    assert "sidecar.heartbeat_misses: must be positive, got 0" in text
    # a bad value names where it came from: the file and key, or the variable
    assert f"{path}: sidecar.heartbeat_misses: must be positive, got 0" in text
    assert "  - PD_TRANSFER_CONTROL_PORT: expected int, got 'eighty'" in text
    assert f"{path}: sidecar: unknown key(s) ['colour']" in text


def test_an_engine_transport_without_its_package_names_the_pip_extra(monkeypatch):
    monkeypatch.setitem(extras._MODULES, "nixl", ("pd_transfer_no_such_module",))
    with pytest.raises(ConfigError) as err:
        load_sidecar_config(None, {"role": "decode", "transport": "nixl"}, {})
    assert "sidecar.transport: the nixl engine is not installed: pip install 'pd-transfer[nixl]'" in str(
        err.value
    )


def test_strategy_is_auto_direct_or_staged_and_slots_hold_a_page():
    config = load_sidecar_config(None, {"role": "prefill"}, {"PD_TRANSFER_STRATEGY": "staged"})
    assert (config.strategy, config.staging_slots, config.staging_slot_nbytes) == ("staged", 16, 4 << 20)
    assert load_sidecar_config(None, {"role": "decode"}, {}).strategy == "auto"
    with pytest.raises(ConfigError) as err:
        load_sidecar_config(None, {"role": "decode", "strategy": "gathered", "staging_slot_nbytes": 512}, {})
    assert "sidecar.strategy: 'gathered' is not one of ['auto', 'direct', 'staged']" in str(err.value)
    assert "sidecar.staging_slot_nbytes: must be at least 4096, got 512" in str(err.value)


def test_copy_threads_default_to_two_and_reach_the_shm_copy_engine():
    import os

    import zmq.asyncio

    from pd_transfer.agent.dataplane import DataPlane
    from pd_transfer.transport.base import TransportKind

    default = load_sidecar_config(None, {"role": "prefill"}, {})
    assert default.copy_threads == min(2, len(os.sched_getaffinity(0)))
    config = load_sidecar_config(None, {"role": "prefill"}, {"PD_TRANSFER_COPY_THREADS": "6"})
    context = zmq.asyncio.Context()
    try:
        assert DataPlane(config, context)._transports[TransportKind.SHM].engine.num_workers == 6
    finally:
        context.term()
    with pytest.raises(ConfigError) as err:
        load_sidecar_config(None, {"role": "prefill", "copy_threads": 0}, {})
    assert "sidecar.copy_threads: must be positive, got 0" in str(err.value)


def test_nixl_ucx_threads_reach_the_writing_agent_and_bad_values_are_refused_by_name():
    import asyncio

    import zmq.asyncio

    from pd_transfer.agent.dataplane import DataPlane
    from pd_transfer.transport.base import TransportKind
    from pd_transfer.transport.engines.registry import engine_unusable

    assert load_sidecar_config(None, {"role": "prefill"}, {}).nixl_ucx_threads == 1
    with pytest.raises(ConfigError) as err:
        load_sidecar_config(
            None, {"role": "prefill", "transport": "tcp"}, {"PD_TRANSFER_NIXL_UCX_THREADS": "4"}
        )
    assert (
        "PD_TRANSFER_NIXL_UCX_THREADS: a transport nixl setting, which transport 'tcp' does not read: "
        'remove it, or set transport = "nixl"'
    ) in str(err.value)
    with pytest.raises(ConfigError) as err:  # decode's agents write nothing but probes
        load_sidecar_config(None, {"role": "decode", "nixl_ucx_threads": 4}, {})
    assert (
        "sidecar.nixl_ucx_threads: a prefill setting, which a decode sidecar does not read: "
        "remove it here, or set it on the prefill sidecars"
    ) in str(err.value)
    if engine_unusable("nixl"):
        pytest.skip(engine_unusable("nixl"))
    for bad in (0, 65):
        with pytest.raises(ConfigError) as err:
            load_sidecar_config(None, {"role": "prefill", "transport": "nixl", "nixl_ucx_threads": bad}, {})
        assert f"sidecar.nixl_ucx_threads: must be 1 to 64, got {bad}: 1 posts each write" in str(err.value)
    config = load_sidecar_config(None, {"role": "prefill", "transport": "nixl", "nixl_ucx_threads": 4}, {})
    context = zmq.asyncio.Context()
    nixl = DataPlane(config, context)._transports[TransportKind.NIXL]
    try:
        assert nixl.engine().agent.get_backend_params("UCX")["num_threads"] == "4"
    finally:
        asyncio.run(nixl.close())
        context.term()


def test_mooncake_protocol_is_tcp_or_rdma():
    with pytest.raises(ConfigError) as err:
        load_sidecar_config(None, {"role": "decode"}, {"PD_TRANSFER_MOONCAKE_PROTOCOL": "ib"})
    assert "PD_TRANSFER_MOONCAKE_PROTOCOL: 'ib' is not one of ['tcp', 'rdma']" in str(err.value)


def test_print_config_round_trips(tmp_path):
    config = load_sidecar_config(None, {"role": "decode", "prefill_bootstraps": ["tcp://h:1"]}, {})
    path = tmp_path / "printed.toml"
    path.write_text(render_toml(config))
    assert load_sidecar_config(str(path), {}, {}) == config


def test_limits_come_from_the_file_the_environment_and_flags(tmp_path, capsys):
    path = _file(tmp_path, 'role = "prefill"\nmax_rooms_per_peer = 8\nmax_inflight_nbytes_total = 4096\n')
    config = load_sidecar_config(
        path,
        {"admission_wait_s": 0.25},
        {"PD_TRANSFER_MAX_WORKER_REQUESTS": "64", "PD_TRANSFER_MAX_CHUNKS_PER_ROOM": "16"},
    )
    assert (config.max_rooms_per_peer, config.max_inflight_nbytes_total) == (8, 4096)
    assert (config.admission_wait_s, config.max_worker_requests, config.max_chunks_per_room) == (0.25, 64, 16)
    with pytest.raises(ConfigError, match="sidecar.admission_wait_s: must be positive, got 0"):
        load_sidecar_config(path, {"admission_wait_s": 0}, {})
    from pd_transfer.cli import main

    assert (
        main(
            [
                "serve",
                "--role",
                "decode",
                "--max-rooms-per-peer",
                "3",
                "--admission-wait-s",
                "1.5",
                "--max-inflight-nbytes-total",
                "65536",
                "--print-config",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "max_rooms_per_peer = 3\n" in printed and "admission_wait_s = 1.5\n" in printed
    assert "max_inflight_nbytes_total = 65536\n" in printed


def test_tcp_streams_reach_the_tcp_transport():
    import zmq.asyncio

    from pd_transfer.agent.tcp_plane import tcp_transport

    assert load_sidecar_config(None, {"role": "prefill"}, {}).tcp_streams == 2
    config = load_sidecar_config(None, {"role": "prefill"}, {"PD_TRANSFER_TCP_STREAMS": "4"})
    context = zmq.asyncio.Context()
    try:
        assert tcp_transport(config, context).streams == 4
    finally:
        context.term()
    with pytest.raises(ConfigError) as err:
        load_sidecar_config(None, {"role": "prefill", "tcp_streams": 0}, {})
    assert "sidecar.tcp_streams: must be positive, got 0" in str(err.value)


def test_the_worker_endpoint_is_unix_by_default_and_a_unix_ipc_or_tcp_address():
    config = load_sidecar_config(None, {"role": "decode", "agent_id": "d7"}, environ={})
    assert config.worker_endpoint == "unix:///tmp/pd-transfer-d7.sock"
    for good in ("unix:///run/pd/w.sock", "ipc:///run/pd/w.sock", "tcp://127.0.0.1:5555"):
        assert (
            load_sidecar_config(None, {"role": "decode", "worker_endpoint": good}, environ={}).worker_endpoint
            == good
        )
    for bad, says in (
        ("http://x", "not a unix://PATH"),
        ("unix://", "needs a path"),
        ("unix:///" + "p" * 120, "107"),
    ):
        with pytest.raises(ConfigError, match=says) as err:
            load_sidecar_config(None, {"role": "decode", "worker_endpoint": bad}, environ={})
        assert "sidecar.worker_endpoint" in str(err.value)
