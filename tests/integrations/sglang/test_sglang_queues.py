"""SGLang's own scheduler queues over pd-transfer's backend and real sidecars.

The queues are driven the way SGLang's CPU unit tests drive them: a
``MagicMock(spec=<Queue>)`` stands in for the scheduler-owned object and the
queue's real methods run on it (``PrefillBootstrapQueue.create_sender`` /
``pop_bootstrapped`` / ``finalize_bootstrap``, ``DecodePreallocQueue.
_create_receiver_and_enqueue`` / ``_init_receiver`` / ``_send_kv_metadata``,
``DecodeTransferQueue.pop_transferred`` / ``resolve_deferred_releases``).
What stays a stand-in is what needs a running scheduler: the KV allocators
and radix tree (page indices are given), the model forward (prefill's pages
are written by the test, sent as ``send_kv_chunk`` sends them) and the output
streamer. Poll results go through SGLang's all-reduce over a one-rank gloo
group, as on a TP 1 server.

- A request goes bootstrap -> prealloc -> transfer -> done and decode's pages
  and metadata row hold prefill's bytes exactly; the request leaves the
  transfer queue with prefill's first token committed.
- A pair the sidecars refuse ends with decode's request aborted by
  ``pop_transferred``, whose abort message carries every mismatch; its pages
  are held by SGLang's deferred release and freed once the sidecar drained.
  Prefill's request, never asked for, fails in the bootstrap queue by the
  backend's bootstrap timeout, before its forward runs.
"""

from __future__ import annotations

import time
import types
from types import SimpleNamespace
from unittest.mock import MagicMock

import numpy as np
import pytest
import torch
import torch.distributed as dist
from sglang.srt.disaggregation import decode as sgl_decode
from sglang.srt.disaggregation import prefill as sgl_prefill
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator, TransferBackend
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang_deployment import Deployment
from sglang_ranks import NUM_AUX_ROWS, build_rank

from pd_transfer.integrations.sglang.registration import EngineFacts
from pd_transfer.ports import spare_port

LAYERS, HEADS, HEAD_DIM, PAGE, POOL_TOKENS = 2, 2, 8, 4, 64
# SGLang's server defaults for what its queues read from the published disagg config
DISAGG_DEFAULTS = SimpleNamespace(
    disaggregation_decode_allocation_policy="early",
    optimistic_prefill_attempts=0,
    disaggregation_decode_host_receive_threshold=1.0,
)


@pytest.fixture(scope="module", autouse=True)
def one_rank_gloo_group():
    """SGLang all-reduces every poll over the attention-TP CPU group: a TP 1 server's."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spare_port()}", rank=0, world_size=1)
    yield


@pytest.fixture(autouse=True)
def sglang_backend(monkeypatch):
    from sglang.srt.plugins import load_plugins

    load_plugins()
    monkeypatch.setattr(sgl_prefill, "get_disagg", lambda: DISAGG_DEFAULTS)
    monkeypatch.setattr(sgl_decode, "get_disagg", lambda: DISAGG_DEFAULTS)
    return TransferBackend("pd_transfer")


def real(queue, cls, *names):
    """Run ``cls``'s own methods on the stand-in queue."""
    for name in names:
        setattr(queue, name, types.MethodType(getattr(cls, name), queue))


def make_req(room: int, deployment: Deployment, num_tokens: int):
    req = MagicMock()
    req.rid = f"req-{room}"
    req.bootstrap_room = room
    req.bootstrap_host, port = deployment.sglang_bootstrap.split(":")
    req.bootstrap_port = int(port)
    req.disagg_prefill_dp_rank = None
    req.origin_input_ids = list(range(num_tokens))
    req.output_ids = []
    req.finished_reason = None
    req.return_logprob = False
    req.return_sampling_mask = False
    req.is_retracted = False
    req.prefill_attempt_count = 0
    req.metadata_buffer_index = -1
    return req


def bootstrap_queue(rank, backend, port: int):
    queue = MagicMock(spec=PrefillBootstrapQueue)
    queue.queue = []
    queue.kv_manager = rank.manager
    queue.transfer_backend = backend
    queue.bootstrap_port = port
    queue.max_input_len = POOL_TOKENS
    queue.pp_size = 1
    queue.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(NUM_AUX_ROWS)
    queue.scheduler, queue.scheduler_stage_metrics = MagicMock(), None
    queue.scheduler.attn_tp_cpu_group = queue.scheduler.attn_cp_cpu_group = None
    queue.scheduler.token_to_kv_pool_allocator.page_size = PAGE
    real(
        queue,
        PrefillBootstrapQueue,
        "create_sender",
        "pop_bootstrapped",
        "finalize_bootstrap",
        "ensure_metadata_buffer",
        "_num_pages_to_send",
        "_check_if_req_exceed_kv_capacity",
        "_process_req",
        "can_prefill_before_bootstrap",
    )
    return queue


def decode_queues(rank, backend):
    allocator = ReqToMetadataIdxAllocator(NUM_AUX_ROWS)
    transfer = MagicMock(spec=DecodeTransferQueue)
    transfer.queue = []
    transfer.gloo_group, transfer.tp_rank = None, 0
    transfer.metadata_buffers = rank.metadata
    transfer.req_to_metadata_buffer_idx_allocator = allocator
    transfer.enable_staging = transfer.enable_host_receive = False
    transfer.enable_deferred_kv_release = True
    transfer.deferred_kv_release_timeout = 30.0
    transfer._deferred_releases = []
    transfer.scheduler, transfer.spec_algorithm, transfer.scheduler_stage_metrics = (
        MagicMock(),
        MagicMock(),
        None,
    )
    transfer.spec_algorithm.is_none.return_value = True
    transfer.scheduler.enable_decode_hicache = False
    transfer.scheduler.kv_checksum_computer = None
    transfer.released = []
    transfer._release_request = transfer.released.append  # the radix tree's part
    real(
        transfer,
        DecodeTransferQueue,
        "pop_transferred",
        "_poll_with_metadata_gate",
        "_pollers",
        "_commit_transfer_to_req",
        "_is_host_destination",
        "_abort_failed_transfer",
        "_defer_release",
        "_do_release",
        "resolve_deferred_releases",
    )
    prealloc = MagicMock(spec=DecodePreallocQueue)
    prealloc.queue = []
    prealloc.kv_manager = rank.manager
    prealloc.transfer_backend = backend
    prealloc.transfer_queue = transfer
    prealloc.req_to_metadata_buffer_idx_allocator = allocator
    prealloc._num_published_destinations = 0
    real(
        prealloc,
        DecodePreallocQueue,
        "_create_receiver_and_enqueue",
        "_init_receiver",
        "_send_kv_metadata",
        "_transfer_page_indices",
    )
    return prealloc, transfer


def mha_rank(role, deployment, monkeypatch, dtype, tag):
    monkeypatch.setenv("PD_TRANSFER_SGLANG_WORKER_ENDPOINT", deployment.endpoint(role, 0))
    pool = MHATokenToKVPool(
        size=POOL_TOKENS,
        page_size=PAGE,
        dtype=dtype,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    return build_rank(
        role,
        0,
        pool,
        page_size=PAGE,
        num_layers=LAYERS,
        owner=f"{tag}-{role}",
        facts=EngineFacts(attn_tp_size=1, total_kv_heads=HEADS, model="tiny-gqa"),
    )


def poll_until(step, done, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        result = step()
        if done(result) or time.monotonic() > deadline:
            return result
        time.sleep(0.005)


def through_the_queues(prefill, decode, deployment, backend, room, src_pages, dst_pages, forward=None):
    """Bootstrap -> prealloc -> transfer for one request; ``forward(req)`` stands for prefill's
    forward pass (it writes the metadata row). ``(prefill req, decode req, bootstrap, transfer)``."""
    num_tokens = len(src_pages) * PAGE
    p_req, d_req = make_req(room, deployment, num_tokens), make_req(room, deployment, num_tokens)
    bootstrap = bootstrap_queue(prefill, backend, d_req.bootstrap_port)
    assert bootstrap.create_sender(p_req, HEADS)
    bootstrap.queue.append(p_req)
    prealloc, transfer = decode_queues(decode, backend)
    decode_req = prealloc._create_receiver_and_enqueue(d_req)
    prealloc._init_receiver(decode_req, 0)
    dst_tokens = torch.tensor([p * PAGE + t for p in dst_pages for t in range(PAGE)], dtype=torch.int64)
    prealloc._send_kv_metadata(decode_req, dst_tokens, PAGE)
    transfer.queue.append(decode_req)
    popped = poll_until(bootstrap.pop_bootstrapped, lambda out: out or not bootstrap.queue)
    if popped:  # bootstrapped: the forward runs; sent as send_kv_chunk does
        if forward is not None:
            forward(p_req)
        sender = p_req.disagg_kv_sender
        for start in range(0, len(src_pages), 2):
            sender.send(np.array(src_pages[start : start + 2], dtype=np.int64))
    return p_req, d_req, bootstrap, transfer


def test_a_request_goes_through_sglangs_queues_byte_exact(tmp_path, monkeypatch, sglang_backend):
    deployment = Deployment(tmp_path, 1, 1)
    ranks = []
    try:
        ranks = [
            mha_rank("prefill", deployment, monkeypatch, torch.bfloat16, "q1"),
            mha_rank("decode", deployment, monkeypatch, torch.bfloat16, "q1"),
        ]
        prefill, decode = ranks
        src_pages, dst_pages = [5, 2, 9], [3, 11, 7]
        rng = np.random.default_rng(23)
        for buf in prefill.pool.k_buffer + prefill.pool.v_buffer:
            buf.view(torch.int16).copy_(
                torch.from_numpy(rng.integers(1, 2**15, size=tuple(buf.shape), dtype=np.int16))
            )

        def forward(req):  # what prefill's forward leaves in the request's metadata row
            prefill.metadata.output_ids[req.metadata_buffer_index, 0] = 31337
            prefill.metadata.bootstrap_room[req.metadata_buffer_index, 0] = 4711

        p_req, d_req, bootstrap, transfer = through_the_queues(
            prefill, decode, deployment, sglang_backend, 4711, src_pages, dst_pages, forward
        )
        assert bootstrap.queue == [] and p_req.metadata_buffer_index >= 0, "the request never bootstrapped"
        assert p_req.disagg_kv_sender.num_pages == len(src_pages)  # finalize_bootstrap's init
        done = poll_until(transfer.pop_transferred, lambda out: out or not transfer.queue)
        assert done == [d_req], [r.kv_receiver.failure for r in transfer.queue if r.kv_receiver]
        assert d_req.output_ids == [31337], "the first token did not reach decode's request"
        assert (
            poll_until(p_req.disagg_kv_sender.poll, lambda s: s in (KVPoll.Success, KVPoll.Failed))
            == KVPoll.Success
        )
        for src, dst in zip(
            prefill.pool.k_buffer + prefill.pool.v_buffer, decode.pool.k_buffer + decode.pool.v_buffer
        ):
            s = src.view(torch.int16).numpy().reshape(-1, PAGE, HEADS, HEAD_DIM)
            d = dst.view(torch.int16).numpy().reshape(-1, PAGE, HEADS, HEAD_DIM)
            np.testing.assert_array_equal(d[dst_pages], s[src_pages])
            assert not d[[p for p in range(d.shape[0]) if p not in dst_pages]].any()
        assert transfer.released == [] and transfer.queue == []
    finally:
        for rank in ranks:
            rank.close()
        deployment.close()


def test_a_refused_pair_aborts_the_request_in_sglangs_transfer_queue_with_the_reason(
    tmp_path, monkeypatch, sglang_backend
):
    deployment = Deployment(tmp_path, 1, 1)
    monkeypatch.setenv("PD_TRANSFER_SGLANG_BOOTSTRAP_TIMEOUT_S", "600")  # no timeout stands in
    ranks = []
    try:
        ranks = [
            mha_rank("prefill", deployment, monkeypatch, torch.bfloat16, "q2"),
            mha_rank("decode", deployment, monkeypatch, torch.float16, "q2"),
        ]
        prefill, decode = ranks
        p_req, d_req, bootstrap, transfer = through_the_queues(
            prefill, decode, deployment, sglang_backend, 4712, [1, 2], [3, 4]
        )
        assert poll_until(transfer.pop_transferred, lambda out: out or not transfer.queue) == []
        assert isinstance(d_req.finished_reason, FINISH_ABORT), "the refused request was not aborted"
        message = d_req.finished_reason.message
        for name in ("k", "v"):
            assert f"kv.layer[0-1].{name}.dtype: prefill=bfloat16 decode=float16" in message, message
        assert "dtype_mismatch" in message and "hint: configure the same KV/state dtype" in message, message
        transfer.scheduler.output_streamer.stream_output.assert_called()
        # SGLang holds the pages until the backend says no write can land; then frees them
        assert [entry[0].req for entry in transfer._deferred_releases] == [d_req]
        assert (
            poll_until(lambda: (transfer.resolve_deferred_releases(), transfer.released)[1], bool, 15)
            == [transfer.released[0]]
            and transfer.released[0].req is d_req
        )
        assert transfer._deferred_releases == [] and decode.manager.deferred == {}
        # prefill: the refused decode's sidecar tells prefill's (RoomRefused), so the sender
        # fails with decode's text and the bootstrap queue hands it to the scheduler without
        # running its forward
        assert bootstrap.queue == [] and p_req.metadata_buffer_index == -1
        bootstrap.scheduler.handle_bootstrap_failure.assert_called_once_with(p_req)
        failure = p_req.disagg_kv_sender.failure
        assert failure.startswith("[peer_rejected] room 4712: ") and "dtype_mismatch" in failure, failure
    finally:
        for rank in ranks:
            rank.close()
        deployment.close()
