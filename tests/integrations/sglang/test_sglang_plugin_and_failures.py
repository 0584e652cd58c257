"""The plugin as SGLang loads it, and failures through SGLang's interface.

- ``load_plugins()`` finds pd-transfer under ``sglang.srt.plugins`` and, after
  it, SGLang's own ``get_kv_class`` and argument parser know ``pd_transfer``.
- A pair the sidecars refuse (a KV dtype that differs) fails the request in
  SGLang with the whole mismatch text, both values and the hint.
- A prefill sidecar killed during a room fails decode's receiver with a reason
  in bounded time.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from importlib.metadata import entry_points

import pytest
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import KVTransferError
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.plugins import load_plugins
from sglang_deployment import Deployment, wait_for
from sglang_process import Topology, llama_dir, queue_rank
from sglang_ranks import metadata_buffers

from pd_transfer.integrations.sglang import conn


def test_sglang_loads_the_plugin_and_routes_its_backend_to_pd_transfer():
    names = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert names.get("pd_transfer") == "pd_transfer.integrations.sglang.plugin:load"
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.disaggregation import prefill, utils

    backend = utils.TransferBackend("pd_transfer")
    for kind, cls in (
        ("MANAGER", conn.PdTransferKVManager),
        ("SENDER", conn.PdTransferKVSender),
        ("RECEIVER", conn.PdTransferKVReceiver),
        ("BOOTSTRAP_SERVER", conn.PdTransferKVBootstrapServer),
    ):
        assert utils.get_kv_class(backend, utils.KVClassType[kind]) is cls
        assert prefill.get_kv_class(backend, utils.KVClassType[kind]) is cls  # every module's copy
    assert utils.get_kv_class(utils.TransferBackend.FAKE, utils.KVClassType.SENDER).__name__ == "FakeKVSender"
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "x", "--disaggregation-transfer-backend", "pd_transfer"])
    assert args.disaggregation_transfer_backend == "pd_transfer"


def test_the_backend_enum_hack_refuses_an_sglang_it_does_not_know():
    import enum

    from pd_transfer.integrations.sglang.backend_enum import UnknownSglangVersion, add_backend_member

    class FutureBackend(enum.Enum):
        MOONCAKE = "mooncake"
        NIXL = "nixl"
        UCCL = "uccl"

    with pytest.raises(UnknownSglangVersion, match=r"this SGLang has \['MOONCAKE', 'NIXL', 'UCCL'\]"):
        add_backend_member(FutureBackend)
    assert "pd_transfer" not in FutureBackend._value2member_map_


def _rank(role, deployment, monkeypatch, dtype, model_dir):
    """SGLang's queue for ``role`` (TP 1), its manager built through the plugin's hook."""
    monkeypatch.setenv("PD_TRANSFER_SGLANG_WORKER_ENDPOINT", deployment.endpoint(role, 0))
    pool = MHATokenToKVPool(
        size=32,
        page_size=4,
        dtype=dtype,
        head_num=2,
        head_dim=8,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    return queue_rank(role, Topology(1), 0, model_dir, pool=pool, metadata=metadata_buffers())


@contextlib.contextmanager
def requested_room(tmp_path, monkeypatch, room: int, decode_dtype=torch.bfloat16):
    """A TP 1 pair with ``room`` requested by decode: ``(deployment, receiver, sender)``."""
    load_plugins()
    model_dir = llama_dir(tmp_path, "tiny", layers=2, kv_heads=2, head_dim=8)
    deployment = Deployment(tmp_path, 1, 1)
    ranks = []
    try:
        ranks.append(_rank("prefill", deployment, monkeypatch, torch.bfloat16, model_dir))
        ranks.append(_rank("decode", deployment, monkeypatch, decode_dtype, model_dir))
        receiver = conn.PdTransferKVReceiver(ranks[1].manager, deployment.sglang_bootstrap, room)
        receiver.init(0)
        receiver.send_metadata([1, 2], 0, None)
        yield (
            deployment,
            receiver,
            conn.PdTransferKVSender(ranks[0].manager, deployment.sglang_bootstrap, room),
        )
    finally:
        for rank in ranks:
            rank.close()
        deployment.close()


def test_a_refused_pair_fails_the_request_with_every_mismatch(tmp_path, monkeypatch):
    with requested_room(tmp_path, monkeypatch, 99, decode_dtype=torch.float16) as (_, receiver, _sender):
        assert wait_for([receiver], KVPoll.Failed, 30) == [KVPoll.Failed]
        with pytest.raises(KVTransferError) as caught:
            receiver.failure_exception()
        text = str(caught.value)
        for name in ("k", "v"):
            assert f"kv.layer[0-1].{name}.dtype: prefill=bfloat16 decode=float16" in text, text
        assert "dtype_mismatch" in text and "hint" in text, text


def test_a_killed_prefill_sidecar_fails_the_receiver_in_bounded_time(tmp_path, monkeypatch):
    with requested_room(tmp_path, monkeypatch, 5) as (deployment, receiver, sender):
        assert wait_for([sender], KVPoll.WaitingForInput, 30) == [KVPoll.WaitingForInput]
        deployment.sidecars[("prefill", 0)].kill()
        started = time.monotonic()
        assert wait_for([receiver], KVPoll.Failed, 30) == [KVPoll.Failed]
        assert time.monotonic() - started < 15
        with pytest.raises(KVTransferError, match=r"\[\w+\]"):
            receiver.failure_exception()
        # a lost writer is not a drained one: the pages stay fenced (fail closed)
        receiver.abort()
        assert receiver.is_abort_release_safe() is False


def test_an_abort_reports_the_pages_safe_only_once_prefill_has_drained(tmp_path, monkeypatch):
    with requested_room(tmp_path, monkeypatch, 6) as (_, receiver, sender):
        assert wait_for([sender], KVPoll.WaitingForInput, 30) == [KVPoll.WaitingForInput]
        receiver.abort()
        assert wait_until(receiver.is_abort_release_safe, 10), "the drained abort was never reported safe"
        assert receiver.poll() == KVPoll.Failed
        assert wait_for([sender], KVPoll.Failed, 30) == [KVPoll.Failed]
        with pytest.raises(KVTransferError, match="aborted"):
            sender.failure_exception()


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False
