"""Integrity settings: off by default, on from file, environment or --integrity; who offers it."""

import pytest

from pd_transfer.agent.integrity import FEATURE, features
from pd_transfer.cli import build_parser
from pd_transfer.config.sidecar import load_sidecar_config
from pd_transfer.errors import ConfigError


def test_integrity_is_off_by_default_and_no_fault_is_injected():
    config = load_sidecar_config(None, {"role": "decode"}, {})
    assert config.integrity is False and config.fault_corrupt_nth == 0
    assert features(config, on_device=False) == ()


def test_integrity_from_the_environment_and_the_flag():
    config = load_sidecar_config(None, {"role": "prefill"}, {"PD_TRANSFER_INTEGRITY": "1"})
    assert config.integrity is True
    args = build_parser().parse_args(
        ["serve", "--role", "prefill", "--integrity", "--fault-corrupt-nth", "3"]
    )
    assert (args.integrity, args.fault_corrupt_nth) == (True, 3)
    assert build_parser().parse_args(["serve"]).integrity is None  # unset: the file decides


def test_a_sidecar_offers_integrity_only_for_host_memory():
    config = load_sidecar_config(None, {"role": "decode", "integrity": True}, {})
    assert features(config, on_device=False) == (FEATURE,)
    assert features(config, on_device=True) == ()  # the sums read regions on the CPU


def test_fault_corrupt_nth_accepts_zero_and_refuses_negatives():
    assert load_sidecar_config(None, {"role": "decode", "fault_corrupt_nth": 0}, {}).fault_corrupt_nth == 0
    with pytest.raises(ConfigError, match="sidecar.fault_corrupt_nth: must be positive, got -1"):
        load_sidecar_config(None, {"role": "decode", "fault_corrupt_nth": -1}, {})


def test_the_fault_switch_is_marked_test_only_in_help():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    text = serve.format_help()
    assert "TEST ONLY" in text and "--fault-corrupt-nth" in text
