"""What the SGLang backend adds to a transfer: the same request through SGLang's
interface and through pd-transfer's client directly, on the same sidecars.

    <sglang venv>/bin/python benchmarks/sglang_bench.py [--tokens 8192] [--repeats 5]

Run it with the environment ``.ci/engine-venv-sglang`` prints. One prefill and
one decode sidecar (shm, TP 1 -> 1); each side an SGLang ``MHATokenToKVPool``
of Llama-3.1-8B's shape (32 layers, 8 KV heads, head_dim 128, bfloat16, page
16) registered through the backend's manager. Per round, one request of
``--tokens`` tokens, random pages, both ways (which goes first alternates by
round; every page is touched before the first):

- client: decode's ``expect``, prefill polls until decode's request is in,
  ``send``, decode's ``wait``;
- SGLang: ``send_metadata``, the sender polled until ``WaitingForInput``,
  ``init`` + ``send``, the receiver polled until ``Success`` (as SGLang's
  scheduler polls, once per step: 1 ms apart).

Each is timed from the send to decode seeing Success. Prints the medians and
their ratio; no assertion.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.utils import (
    DisaggregationMode,
    MetadataBuffers,
    get_kv_transfer_buf_infos,
    setup_state_kv_args,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from pd_transfer.client import Refused, RoomStatus
from pd_transfer.errors import Reason
from pd_transfer.integrations.sglang.conn import (
    ENGINE_MEMORY,
    PdTransferKVManager,
    PdTransferKVReceiver,
    PdTransferKVSender,
)
from pd_transfer.integrations.sglang.facts import EngineFacts
from pd_transfer.integrations.sglang.memory import share_engine_memory
from pd_transfer.processes.ports import spare_port
from pd_transfer.security.secret import use_ephemeral_secret

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
POLL_S = 0.001  # SGLang polls once per scheduler step


def start_sidecar(workdir: Path, role: str, bootstrap: str) -> tuple[subprocess.Popen, str]:
    endpoint = f"unix://{workdir}/{role}.sock"
    ready = workdir / f"{role}.json"
    cmd = [
        sys.executable,
        "-m",
        "pd_transfer.cli",
        "serve",
        "--role",
        role,
        "--agent-id",
        role,
        "--worker-endpoint",
        endpoint,
        "--ready-file",
        str(ready),
        "--http-port",
        "0",
        "--transport",
        "shm",
        "--log-level",
        "warning",
    ]
    if role == "prefill":
        cmd += ["--bootstrap", bootstrap]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the {role} sidecar did not start (exit {proc.poll()})")
        time.sleep(0.02)
    return proc, endpoint


def manager(role: str, endpoint: str, num_tokens: int):
    pool = MHATokenToKVPool(
        size=num_tokens,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=KV_HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    metadata = MetadataBuffers(
        size=8,
        hidden_size=16,
        hidden_states_dtype=torch.float32,
        max_sampling_mask_tokens=4,
        max_top_logprobs_num=4,
    )
    memory = share_engine_memory(f"bench-{role}", kv_pool=pool, metadata_buffers=metadata)
    kv_args = KVArgs()
    kv_args.engine_rank, kv_args.pp_rank, kv_args.gpu_id, kv_args.system_dp_rank = 0, 0, 0, 0
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = get_kv_transfer_buf_infos(pool)
    kv_args.kv_layer_ids, kv_args.num_draft_entries = [], 0
    kv_args.kv_head_num, kv_args.total_kv_head_num, kv_args.page_size = KV_HEADS, KV_HEADS, PAGE
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = metadata.get_buf_infos()
    setup_state_kv_args(kv_args, pool, None, LAYERS)
    os.environ["PD_TRANSFER_SGLANG_WORKER_ENDPOINT"] = endpoint
    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    token = ENGINE_MEMORY.set((memory, EngineFacts(attn_tp_size=1, total_kv_heads=KV_HEADS)))
    try:
        return PdTransferKVManager(kv_args, mode, SimpleNamespace(), False), pool, memory
    finally:
        ENGINE_MEMORY.reset(token)


def until_waiting(client, room: int) -> None:
    while True:
        try:
            if client.poll(room).status is RoomStatus.WAITING_FOR_INPUT:
                return
        except Refused as err:
            if err.code is not Reason.UNKNOWN_ROOM:
                raise
        time.sleep(POLL_S)


def direct_room(prefill, decode, bootstrap: str, room: int, src, dst) -> float:
    decode.client.expect(room, f"tcp://{bootstrap}", dst, aux_row=0)
    until_waiting(prefill.client, room)
    start = time.perf_counter()
    prefill.client.send(room, src, aux_row=0)
    state = decode.client.wait(room, 120)
    elapsed = time.perf_counter() - start
    if not state.succeeded:
        raise RuntimeError(f"room {room}: {state.describe()}")
    prefill.client.wait(room, 30)
    return elapsed


def sglang_room(prefill, decode, bootstrap: str, room: int, src, dst) -> float:
    receiver = PdTransferKVReceiver(decode, bootstrap, room)
    sender = PdTransferKVSender(prefill, bootstrap, room)
    receiver.init(0)
    receiver.send_metadata(np.asarray(dst, dtype=np.int32), 0, None)
    while sender.poll() != KVPoll.WaitingForInput:
        time.sleep(POLL_S)
    start = time.perf_counter()
    sender.init(len(src), 0)
    sender.send(np.asarray(src, dtype=np.int32), None)
    while (state := receiver.poll()) not in (KVPoll.Success, KVPoll.Failed):
        time.sleep(POLL_S)
    elapsed = time.perf_counter() - start
    if state == KVPoll.Failed:
        receiver.failure_exception()
    while sender.poll() not in (KVPoll.Success, KVPoll.Failed):
        time.sleep(POLL_S)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per request")
    parser.add_argument("--repeats", type=int, default=5, help="rounds (each: one request both ways)")
    args = parser.parse_args()
    pages = args.tokens // PAGE
    pool_pages = pages + 64
    port = spare_port()
    bootstrap = f"127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="pdt-sglang-bench-") as tmp:
        workdir = Path(tmp)
        use_ephemeral_secret(workdir)  # the sidecars and the managers' clients share it
        procs, memories = [], []
        try:
            p_proc, p_endpoint = start_sidecar(workdir, "prefill", f"tcp://{bootstrap}")
            procs.append(p_proc)
            d_proc, d_endpoint = start_sidecar(workdir, "decode", "")
            procs.append(d_proc)
            prefill, p_pool, p_mem = manager("prefill", p_endpoint, pool_pages * PAGE)
            decode, d_pool, d_mem = manager("decode", d_endpoint, pool_pages * PAGE)
            memories += [p_mem, d_mem]
            for buf in p_pool.k_buffer + p_pool.v_buffer:
                buf.fill_(1.5)
            for buf in d_pool.k_buffer + d_pool.v_buffer:  # every page mapped before the clock runs
                buf.zero_()
            rng = np.random.default_rng(0)
            direct_room(prefill, decode, bootstrap, 1, [1, 2], [3, 4])  # warm-up: verdicts
            sglang_room(prefill, decode, bootstrap, 2, [1, 2], [3, 4])
            times = {"client": [], "SGLang": []}
            for i in range(args.repeats):
                src = (rng.choice(pool_pages - 1, pages, replace=False) + 1).tolist()
                dst = (rng.choice(pool_pages - 1, pages, replace=False) + 1).tolist()
                ways = [("client", direct_room), ("SGLang", sglang_room)]
                for j, (name, way) in enumerate(ways if i % 2 == 0 else ways[::-1]):
                    times[name].append(way(prefill, decode, bootstrap, 100 + 2 * i + j, src, dst))
            nbytes = pages * PAGE * KV_HEADS * HEAD_DIM * 2 * 2 * LAYERS
            print(
                f"Llama-3.1-8B shape, {args.tokens} tokens, page {PAGE}, random pages: "
                f"{nbytes / 2**30:.2f} GiB of KV per request; shm TP 1 -> 1; medians of {args.repeats}"
            )
            print(f"{'path':26}{'seconds':>10}{'GB/s':>8}")
            for name, values in times.items():
                median = statistics.median(values)
                print(f"{'through ' + name:26}{median:10.3f}{nbytes / median / 1e9:8.2f}")
            ratio = statistics.median(times["SGLang"]) / statistics.median(times["client"])
            print(
                f"SGLang interface / client: {ratio:.3f} (target < 1.05: "
                f"{'met' if ratio < 1.05 else 'missed'})"
            )
            prefill.close()
            decode.close()
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait()
            for memory in memories:
                memory.close()


if __name__ == "__main__":
    main()
