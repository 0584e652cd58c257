"""SGLang's own scheduler queues over pd-transfer's backend and real sidecars.

Every queue is SGLang's real object, built by its constructor on CPU
(:mod:`sglang_process`): ``PrefillBootstrapQueue`` and
``DecodePreallocQueue``, whose constructors build the KV manager through the
plugin's ``_init_kv_manager`` hook, and the ``DecodeTransferQueue`` decode's
prealloc queue hands requests to. Their methods run as SGLang's scheduler
calls them: ``create_sender`` / ``pop_bootstrapped`` (which runs
``finalize_bootstrap``), ``_create_receiver_and_enqueue`` /
``_init_receiver`` / ``_send_kv_metadata``, ``pop_transferred`` /
``resolve_deferred_releases``. What stays a stand-in is what needs a running
scheduler: the scheduler object, the KV allocators and radix tree (page
indices are given; the tree records the rows SGLang's ``release_kv_cache``
frees), the model forward (prefill's pages are written by the test, sent as
``send_kv_chunk`` sends them) and the output streamer. Poll results go
through SGLang's all-reduce over a one-rank gloo group, as on a TP 1 server.

- A request goes bootstrap -> prealloc -> transfer -> done and decode's pages
  and metadata row hold prefill's bytes exactly; the request leaves the
  transfer queue with prefill's first token committed, its metadata row
  given back, and no KV row freed (decode keeps it).
- A pair the sidecars refuse ends with decode's request aborted by
  ``pop_transferred``, whose abort message carries every mismatch; its pages
  are held by SGLang's deferred release and freed (the radix tree's
  ``free_kv_row``) only once the sidecar drained. Prefill's request fails in
  the bootstrap queue with decode's text (the sidecars tell prefill), handed
  to the scheduler's ``handle_bootstrap_failure`` before its forward runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from unittest.mock import MagicMock

import numpy as np
import pytest
import torch
import torch.distributed as dist
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.plugins import load_plugins
from sglang_deployment import Deployment
from sglang_process import Topology, llama_dir, queue_rank, sglang_rank
from sglang_ranks import metadata_buffers

from pd_transfer.processes.ports import spare_port

LAYERS, HEADS, HEAD_DIM, PAGE, POOL_TOKENS = 2, 2, 8, 4, 64


@pytest.fixture(scope="module", autouse=True)
def one_rank_gloo_group():
    """SGLang all-reduces every poll over the attention-TP CPU group: a TP 1 server's."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spare_port()}", rank=0, world_size=1)
    yield


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """One prefill and one decode sidecar for the module; each test registers its ranks anew."""
    sidecars = Deployment(tmp_path_factory.mktemp("queue-sidecars"), 1, 1)
    yield sidecars
    sidecars.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    load_plugins()
    return llama_dir(
        tmp_path_factory.mktemp("queues"), "tiny", layers=LAYERS, kv_heads=HEADS, head_dim=HEAD_DIM
    )


@pytest.fixture(autouse=True)
def published(model_dir):
    """What a running server publishes once at start and the queues' methods read
    (``get_disagg``, ``get_spec``, ...): SGLang's server args with its defaults."""
    with sglang_rank("decode", Topology(1), 0, model_path=model_dir):
        yield


@dataclass(eq=False)
class KvRow:
    """A request's KV record as SGLang's ``release_kv_cache`` reads and marks it."""

    kv_allocated_len: int
    kv_committed_len: int
    cache_protected_len: int = 0
    holds_kv: bool = True
    is_kv_released: bool = False

    def mark_kv_released(self) -> None:
        self.holds_kv, self.is_kv_released = False, True


def make_req(room: int, deployment: Deployment, num_tokens: int):
    """A request as the queues read it (SGLang's ``Req`` needs a tokenizer manager to build)."""
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
    req.skip_radix_cache_insert = False
    req.finished_len = None
    req.lock = None
    # the KV row decode's allocator gave it (release_kv_cache frees it into the radix tree)
    req.kv = KvRow(kv_allocated_len=num_tokens, kv_committed_len=num_tokens)
    req.owned_kv_len.return_value = num_tokens
    return req


def mha_rank(role, deployment, monkeypatch, dtype, model_dir):
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
    _, port = deployment.sglang_bootstrap.split(":")
    return queue_rank(
        role, Topology(1), 0, model_dir, pool=pool, metadata=metadata_buffers(), bootstrap_port=int(port)
    )


def poll_until(step, done, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        result = step()
        if done(result) or time.monotonic() > deadline:
            return result
        time.sleep(0.005)


def through_the_queues(prefill, decode, deployment, room, src_pages, dst_pages, forward=None):
    """Bootstrap -> prealloc -> transfer for one request; ``forward(req)`` stands for prefill's
    forward pass (it writes the metadata row). ``(prefill req, decode req)``."""
    num_tokens = len(src_pages) * PAGE
    p_req, d_req = make_req(room, deployment, num_tokens), make_req(room, deployment, num_tokens)
    bootstrap, prealloc = prefill.queue, decode.queue
    assert bootstrap.create_sender(p_req, HEADS)
    bootstrap.queue.append(p_req)
    decode_req = prealloc._create_receiver_and_enqueue(d_req)
    prealloc._init_receiver(decode_req, 0)
    dst_tokens = torch.tensor([p * PAGE + t for p in dst_pages for t in range(PAGE)], dtype=torch.int64)
    prealloc._send_kv_metadata(decode_req, dst_tokens, PAGE)
    prealloc.queue.remove(decode_req)
    prealloc.transfer_queue.queue.append(decode_req)
    popped = poll_until(bootstrap.pop_bootstrapped, lambda out: out or not bootstrap.queue)
    if popped:  # bootstrapped: the forward runs; sent as send_kv_chunk does
        if forward is not None:
            forward(p_req)
        sender = p_req.disagg_kv_sender
        for start in range(0, len(src_pages), 2):
            sender.send(np.array(src_pages[start : start + 2], dtype=np.int64))
    return p_req, d_req


def test_a_request_goes_through_sglangs_queues_byte_exact(deployment, monkeypatch, model_dir):
    ranks = []
    try:
        ranks = [
            mha_rank("prefill", deployment, monkeypatch, torch.bfloat16, model_dir),
            mha_rank("decode", deployment, monkeypatch, torch.bfloat16, model_dir),
        ]
        prefill, decode = ranks
        transfer = decode.queue.transfer_queue
        rows_free = transfer.req_to_metadata_buffer_idx_allocator.available_size()
        src_pages, dst_pages = [5, 2, 9], [3, 11, 7]
        rng = np.random.default_rng(23)
        for buf in prefill.pool.k_buffer + prefill.pool.v_buffer:
            buf.view(torch.int16).copy_(
                torch.from_numpy(rng.integers(1, 2**15, size=tuple(buf.shape), dtype=np.int16))
            )

        def forward(req):  # what prefill's forward leaves in the request's metadata row
            prefill.metadata.output_ids[req.metadata_buffer_index, 0] = 31337
            prefill.metadata.bootstrap_room[req.metadata_buffer_index, 0] = 4711

        p_req, d_req = through_the_queues(prefill, decode, deployment, 4711, src_pages, dst_pages, forward)
        assert prefill.queue.queue == [] and p_req.metadata_buffer_index >= 0, (
            "the request never bootstrapped"
        )
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
        # a transferred request keeps its KV row; its metadata row is given back, cleared
        assert transfer.tree_cache.freed == [] and transfer.queue == []
        assert transfer.req_to_metadata_buffer_idx_allocator.available_size() == rows_free
        assert not decode.metadata.bootstrap_room.any()  # SGLang's clear_slot: the next owner sees room 0
        transfer.scheduler.output_streamer.stream_output.assert_not_called()
        # a decode-side prefix hit (SGLang's decode radix cache, refused at start) fails the
        # request by name, never moves a whole page list over pages decode kept
        hit = decode.queue._create_receiver_and_enqueue(make_req(4713, deployment, 2 * PAGE))
        decode.queue._init_receiver(hit, 0)
        decode.queue._send_kv_metadata(hit, torch.arange(2 * PAGE), PAGE, decode_prefix_len=PAGE)
        assert hit.kv_receiver.poll() == KVPoll.Failed and not hit.kv_receiver.expected
        assert "decode_prefix_len 4" in hit.kv_receiver.failure, hit.kv_receiver.failure
        assert hit.kv_receiver.failure.startswith("[layout_unsupported]")
    finally:
        for rank in ranks:
            rank.close()


def test_a_refused_pair_aborts_the_request_in_sglangs_transfer_queue_with_the_reason(
    deployment, monkeypatch, model_dir
):
    monkeypatch.setenv("PD_TRANSFER_SGLANG_BOOTSTRAP_TIMEOUT_S", "600")  # no timeout stands in
    ranks = []
    try:
        ranks = [
            mha_rank("prefill", deployment, monkeypatch, torch.bfloat16, model_dir),
            mha_rank("decode", deployment, monkeypatch, torch.float16, model_dir),
        ]
        prefill, decode = ranks
        transfer = decode.queue.transfer_queue
        p_req, d_req = through_the_queues(prefill, decode, deployment, 4712, [1, 2], [3, 4])
        assert poll_until(transfer.pop_transferred, lambda out: out or not transfer.queue) == []
        assert isinstance(d_req.finished_reason, FINISH_ABORT), "the refused request was not aborted"
        message = d_req.finished_reason.message
        for name in ("k", "v"):
            assert f"kv.layer[0-1].{name}.dtype: prefill=bfloat16 decode=float16" in message, message
        assert "dtype_mismatch" in message and "hint: configure the same KV/state dtype" in message, message
        transfer.scheduler.output_streamer.stream_output.assert_called_once_with([d_req], False)
        # SGLang holds the pages until the backend says no write can land; then frees them
        assert [entry[0].req for entry in transfer._deferred_releases] == [d_req]
        assert transfer.tree_cache.freed == [], "the pages were freed before the drain"
        freed = poll_until(
            lambda: (transfer.resolve_deferred_releases(), transfer.tree_cache.freed)[1], bool, 15
        )
        assert freed == [(d_req.kv, [(0, 2 * PAGE)])] and d_req.kv.is_kv_released, freed
        assert transfer._deferred_releases == [] and decode.manager.deferred == {}
        # prefill: the refused decode's sidecar tells prefill's (RoomRefused), so the sender
        # fails with decode's text and the bootstrap queue hands it to the scheduler without
        # running its forward
        assert prefill.queue.queue == [] and p_req.metadata_buffer_index == -1
        prefill.queue.scheduler.handle_bootstrap_failure.assert_called_once_with(p_req)
        failure = p_req.disagg_kv_sender.failure
        assert failure.startswith("[peer_rejected] room 4712: ") and "dtype_mismatch" in failure, failure
    finally:
        for rank in ranks:
            rank.close()
