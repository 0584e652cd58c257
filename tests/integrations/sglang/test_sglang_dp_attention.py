"""DP attention on both sides, routed as SGLang routes requests, through real sidecars.

Prefill runs ``--tp-size 4 --attn-dp-size 2`` (two attention-DP groups of
attention TP 2), decode ``--tp-size 2 --attn-dp-size 2`` (two groups of
attention TP 1); every rank's place comes from SGLang's
``compute_dp_attention_world_info`` and every manager is built by SGLang's
real queues through the plugin's hook (:mod:`sglang_process`). Each prefill
DP group is its own pd-transfer instance, bootstrapping on SGLang's
bootstrap port plus its number.

Requests are placed as SGLang places them: on prefill by its DP
controller's ``follow_bootstrap_room`` dispatch (``bootstrap_room %
dp_size``, or the request's ``routed_dp_rank``), on decode by its prealloc
queue's ``_resolve_pending_reqs`` (the request's ``disagg_prefill_dp_rank``,
else ``bootstrap_room % dp_size`` of the prefill it asked the backend about).
Both prefill groups hold different bytes on the same pages, so a decode rank
paired with the wrong group's KV would not match the oracle: the logical KV
of each request, sliced per rank by plain indexing.

Settings pd-transfer cannot serve are refused when SGLang builds the queue,
by name.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest.mock import MagicMock

import numpy as np
import pytest
import torch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.managers import data_parallel_controller
from sglang.srt.managers.data_parallel_controller import DataParallelController
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.plugins import load_plugins
from sglang_deployment import Deployment, wait_for
from sglang_process import Topology, decode_queue, llama_dir, prefill_queue, scheduler, sglang_rank
from sglang_ranks import metadata_buffers

from pd_transfer.errors import ConfigError
from pd_transfer.integrations.sglang.conn import PdTransferKVSender
from pd_transfer.integrations.sglang.dp_routing import refuse_unsupported
from pd_transfer.integrations.sglang.settings import BackendSettings
from pd_transfer.layout.geometry import Role

LAYERS, KV_HEADS, HEAD_DIM, PAGE, POOL_TOKENS = 2, 4, 8, 4, 64
PREFILL, DECODE = Topology(tp_size=4, attn_dp_size=2), Topology(tp_size=2, attn_dp_size=2)


class Rank:
    def __init__(self, role: str, topology: Topology, tp_rank: int, queue, pool) -> None:
        self.role, self.topology, self.tp_rank = role, topology, tp_rank
        ranks = topology.ranks(tp_rank)
        self.group, self.attn_tp_rank, self.attn_tp_size = (
            ranks["attn_dp_rank"],
            ranks["attn_tp_rank"],
            ranks["attn_tp_size"],
        )
        self.queue, self.pool, self.manager = queue, pool, queue.kv_manager

    def heads(self) -> slice:
        per = KV_HEADS // self.attn_tp_size
        return slice(self.attn_tp_rank * per, (self.attn_tp_rank + 1) * per)

    def close(self) -> None:
        self.manager.close()
        self.manager.memory.close()


def build(role, topology, tp_rank, deployment, monkeypatch, model_dir, **server_fields) -> Rank:
    monkeypatch.setenv("PD_TRANSFER_SGLANG_WORKER_ENDPOINT", deployment.endpoint(role, tp_rank))
    attn_tp = topology.ranks(tp_rank)["attn_tp_size"]
    with sglang_rank(role, topology, tp_rank, model_path=model_dir, **server_fields) as server_args:
        pool = MHATokenToKVPool(
            size=POOL_TOKENS,
            page_size=PAGE,
            dtype=torch.bfloat16,
            head_num=KV_HEADS // attn_tp,
            head_dim=HEAD_DIM,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
        )
        stand_in = scheduler(server_args, ModelConfig(model_dir), pool, PAGE)
        metadata = metadata_buffers()
        if role == "prefill":
            queue = prefill_queue(stand_in, pool, metadata)
        else:
            queue = decode_queue(stand_in, metadata)
    return Rank(role, topology, tp_rank, queue, pool)


def logical_kv(room: int, num_tokens: int) -> np.ndarray:
    """``[k|v, layer, token, global head, dim]`` of room ``room``, as raw bfloat16 bits."""
    rng = np.random.default_rng(room)
    return rng.integers(1, 2**15, size=(2, LAYERS, num_tokens, KV_HEADS, HEAD_DIM), dtype=np.int16)


def write(rank: Rank, kv: np.ndarray, pages: list[int]) -> None:
    for which, buffers in enumerate((rank.pool.k_buffer, rank.pool.v_buffer)):
        for layer, buf in enumerate(buffers):
            for i, page in enumerate(pages):
                tokens = kv[which, layer, i * PAGE : (i + 1) * PAGE, rank.heads()]
                buf.view(torch.int16)[page * PAGE : (page + 1) * PAGE] = torch.from_numpy(tokens)


def landed(rank: Rank, pages: list[int]) -> np.ndarray:
    """``[k|v, layer, token, head, dim]`` on ``pages`` of a decode rank's pool."""
    out = []
    for buffers in (rank.pool.k_buffer, rank.pool.v_buffer):
        layers = [
            buf.view(torch.int16).numpy().reshape(-1, PAGE, KV_HEADS, HEAD_DIM)[pages] for buf in buffers
        ]
        out.append(np.stack(layers).reshape(LAYERS, -1, KV_HEADS, HEAD_DIM))
    return np.stack(out)


def prefill_group_of(req) -> int:
    """The prefill DP group SGLang's DP controller sends ``req`` to (follow_bootstrap_room)."""
    controller = MagicMock(spec=DataParallelController)
    controller.workers = ["group0", "group1"]
    controller._active_workers = [0, 1]
    sent = []
    controller.maybe_external_dp_rank_routing = lambda r: (
        DataParallelController.maybe_external_dp_rank_routing(controller, r)
    )
    original = data_parallel_controller.sock_send
    data_parallel_controller.sock_send = lambda worker, r: sent.append(worker)
    try:
        DataParallelController.follow_bootstrap_room_scheduler(controller, req)
    finally:
        data_parallel_controller.sock_send = original
    return controller.workers.index(sent[0])


def request(room: int, deployment: Deployment, prefill_dp_rank: int | None):
    host, port = deployment.sglang_bootstrap.split(":")
    return SimpleNamespace(
        rid=f"req-{room}",
        bootstrap_room=room,
        bootstrap_host=host,
        bootstrap_port=int(port),
        routed_dp_rank=prefill_dp_rank,  # what the router tells prefill
        disagg_prefill_dp_rank=prefill_dp_rank,  # and decode
    )


@pytest.fixture
def model_dir(tmp_path):
    load_plugins()
    return llama_dir(tmp_path, "model", layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM)


def test_each_request_lands_from_its_own_prefill_dp_group(tmp_path, monkeypatch, model_dir):
    deployment = Deployment(tmp_path, prefill_tp=2, decode_tp=2, prefill_dp=2)
    prefill = decode = []
    try:
        monkeypatch.setenv("PD_TRANSFER_SGLANG_PREFILL_DP_SIZE", "2")  # the SGLang processes' setting
        prefill = [build("prefill", PREFILL, r, deployment, monkeypatch, model_dir) for r in range(4)]
        decode = [build("decode", DECODE, r, deployment, monkeypatch, model_dir) for r in range(2)]
        # (room, router's prefill DP rank, decode rank, prefill pages, decode pages)
        plan = [
            (1000, None, 0, [1, 2], [3, 4]),
            (1001, None, 1, [1, 2], [3, 4]),
            (1002, 1, 0, [5, 6], [8, 9]),
        ]
        for rank in prefill:  # a decoy in group 0 where group 1 keeps room 1002
            write(rank, logical_kv(7, 2 * PAGE), [5, 6])
        senders, receivers = [], []
        for row, (room, routed, decode_rank, src, dst) in enumerate(plan):
            group = prefill_group_of(request(room, deployment, routed))
            assert group == (routed if routed is not None else room % 2)
            for rank in (r for r in prefill if r.group == group):
                write(rank, logical_kv(room, len(src) * PAGE), src)
                senders.append(
                    (PdTransferKVSender(rank.manager, deployment.sglang_bootstrap, room), src, row)
                )
            queue = decode[decode_rank].queue
            with sglang_rank("decode", DECODE, decode_rank, model_path=model_dir):
                decode_req = queue._create_receiver_and_enqueue(request(room, deployment, routed))
                queue.pending_reqs = [decode_req]
                queue._resolve_pending_reqs()  # SGLang picks the prefill DP rank and inits the receiver
            assert queue.pending_reqs == [] and decode_req.kv_receiver.prefill_dp_rank == group
            decode_req.kv_receiver.send_metadata(dst, row, None)
            receivers.append(decode_req.kv_receiver)
        states = wait_for([s for s, _, _ in senders], KVPoll.WaitingForInput)
        assert states == [KVPoll.WaitingForInput] * 6, [s.failure for s, _, _ in senders]
        for sender, src, row in senders:
            sender.init(len(src), row)
            sender.send(src)
        assert wait_for(receivers, KVPoll.Success) == [KVPoll.Success] * 3, [r.failure for r in receivers]
        for room, _, decode_rank, src, dst in plan:
            np.testing.assert_array_equal(
                landed(decode[decode_rank], dst), logical_kv(room, len(src) * PAGE), err_msg=f"room {room}"
            )
    finally:
        for rank in prefill + decode:
            rank.close()
        deployment.close()


@pytest.mark.parametrize(
    ("role", "server_fields", "env", "named"),
    [
        ("prefill", {"load_balance_method": "round_robin"}, {}, "--load-balance-method round_robin"),
        (
            "decode",
            {},
            {"SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK": "1"},
            "SGLANG_DISAGGREGATION_FORCE",
        ),
    ],
)
def test_what_pd_transfer_cannot_route_is_refused_when_sglang_builds_the_queue(
    tmp_path, monkeypatch, model_dir, role, server_fields, env, named
):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    topology = PREFILL if role == "prefill" else DECODE
    unused = SimpleNamespace(endpoint=lambda role, rank: f"unix://{tmp_path}/none.sock")
    with pytest.raises(ConfigError) as refused:
        build(role, topology, 0, unused, monkeypatch, model_dir, **server_fields)
    assert named in str(refused.value) and "hint:" in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    ("parallel", "named"),
    [
        ({"attn_cp_size": 2}, "--attn-cp-size 2"),
        ({"enable_kv_cache_sharding": True}, "--enable-kv-cache-sharding"),
        ({"dp_size": 2, "attn_dp_size": 2}, "--dp-size 2 with --attn-dp-size 2"),
    ],
)
def test_context_parallel_and_nested_dp_groups_are_refused_by_name(parallel, named):
    with pytest.raises(ConfigError, match=named):
        refuse_unsupported(SimpleNamespace(**parallel), Role.PREFILL, False)


def test_a_prefill_dp_size_below_one_is_refused():
    with pytest.raises(ConfigError, match="PD_TRANSFER_SGLANG_PREFILL_DP_SIZE=0"):
        BackendSettings.from_environ({"PD_TRANSFER_SGLANG_PREFILL_DP_SIZE": "0"})
