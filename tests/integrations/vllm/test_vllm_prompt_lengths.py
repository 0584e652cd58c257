"""Every prompt length, long prompts, prefix-cache hits and different block sizes, through both
vLLM schedulers and their workers' connectors over real sidecars, byte-exact against an oracle.

A room moves the KV of a prompt's first ``n - 1`` tokens (decode computes
the last one): a prompt of ``k * B + 1`` tokens fills ``k + 1`` blocks but
moves ``k`` pages. Decode must expect exactly the pages prefill sends, in its
own block size, and then compute only the last prompt token
(:mod:`vllm_traffic` plays the forward pass and holds the oracle).
"""

from __future__ import annotations

import pytest

# a specific module: the directory tests/integrations/vllm/ itself imports as a namespace "vllm"
pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed here: run tests/integrations/vllm with the "
    "python printed by .ci/engine-venv-vllm",
)

import torch  # noqa: E402
from vllm_traffic import Side, assert_loaded_then_ran_one_token, check_loaded_kv, run_pd  # noqa: E402

from pd_transfer.processes.ports import spare_port  # noqa: E402

NUM_BLOCKS = 1200
LONG = 3000  # tokens: 188 pages of 16, 94 of 32


def prompt(n: int, seed: int) -> list[int]:
    """``n`` tokens; the first one differs between seeds, so no two prompts share a prefix."""
    return [3 + seed % 250] + [3 + (seed * 7919 + i * 31) % 250 for i in range(1, n)]


def pair(instances, model_dir, prefill_block: int, decode_block: int, decode_tp: int = 2):
    bootstrap = f"tcp://127.0.0.1:{spare_port()}"
    prefill = Side(instances, model_dir, "kv_producer", 1, bootstrap, prefill_block, NUM_BLOCKS)
    decode = Side(instances, model_dir, "kv_consumer", decode_tp, bootstrap, decode_block, NUM_BLOCKS)
    return prefill, decode


def assert_all_blocks_returned(*sides: Side) -> None:
    for side in sides:
        assert side.num_free_blocks() == side.free_at_start, side.sched.vllm_config.kv_transfer_config.kv_role


@pytest.mark.parametrize("block_size", [16, 32])
def test_every_prompt_length_up_to_4b_plus_1_and_a_long_prompt_decode_from_prefills_kv(
    instances, model_dir, block_size
):
    prefill, decode = pair(instances, model_dir, block_size, block_size)
    lengths = list(range(1, 4 * block_size + 2)) + [LONG]
    reqs = run_pd(prefill, decode, [prompt(n, seed) for seed, n in enumerate(lengths)])
    assert_loaded_then_ran_one_token(decode, reqs)  # the KV itself is checked as each first runs
    for i, n in enumerate(lengths):
        if n > 1:
            pages = -(-(n - 1) // block_size)
            assert len(decode.recvs[reqs[i].request_id].block_ids) == pages, n
    assert_all_blocks_returned(prefill, decode)


@pytest.mark.parametrize(("prefill_block", "decode_block"), [(16, 32), (32, 16)])
def test_prefill_and_decode_at_different_block_sizes(instances, model_dir, prefill_block, decode_block):
    prefill, decode = pair(instances, model_dir, prefill_block, decode_block)
    lengths = [2, 15, 16, 17, 18, 31, 32, 33, 34, 48, 49, 63, 64, 65, 66, 96, 97, 129, 1000]
    reqs = run_pd(prefill, decode, [prompt(n, seed) for seed, n in enumerate(lengths)])
    assert_loaded_then_ran_one_token(decode, reqs)
    for i, n in enumerate(lengths):
        assert len(decode.recvs[reqs[i].request_id].block_ids) == -(-(n - 1) // decode_block), n
    assert_all_blocks_returned(prefill, decode)


def test_prefix_cache_hits_on_prefill_and_on_decode_keep_the_kv_exact(instances, model_dir):
    prefill, decode = pair(instances, model_dir, 16, 16, decode_tp=1)
    first = [prompt(n, seed) for seed, n in enumerate([48, 40, 70, 33])]
    run_pd(prefill, decode, first)
    # the same prefixes again, each continued: both sides hold those blocks in their prefix caches
    second = [
        first[0] + [9],  # 49 tokens: decode already holds all 48 it loads
        first[1] + [11] * 30,  # decode holds 2 of its 4 loaded pages
        first[2][:50] + [5] * 17,  # a hit that ends inside the first request's prompt
        first[3] + [7] * 16,  # decode's third block of the first request was never full: no hit
    ]
    reqs = run_pd(prefill, decode, second)
    assert_loaded_then_ran_one_token(decode, reqs)
    local = [decode.recvs[reqs[i].request_id].num_local_blocks for i in range(len(second))]
    assert local == [3, 2, 3, 2], local
    hits = [prefill.first_runs[r][0] for r in list(prefill.first_runs)[len(first) :]]
    assert hits == [48, 32, 48, 32], hits  # prefill computed from its hit (whole blocks)
    assert_all_blocks_returned(prefill, decode)


SENTINEL = 0x5A


def test_decode_prefix_cache_hits_are_not_written_over(instances, model_dir):
    """Decode's prefix-cache hit pages are expected as held: prefill writes nothing into them.

    Every byte of the memory each decode rank registered with its sidecar
    (the shared-memory twin of its KV cache) is set to a sentinel before the
    second requests; when decode first runs each of them, its held pages
    still hold the sentinel there (nothing was written into them) while
    every loaded position of vLLM's blocks, held ones from vLLM's own cache
    and the rest from the room, equals the oracle.
    """
    prefill, decode = pair(instances, model_dir, 16, 16, decode_tp=2)
    first = [prompt(n, seed) for seed, n in enumerate([48, 40, 70])]
    run_pd(prefill, decode, first)
    for connector in decode.instance.connectors:
        for twin in connector._worker.pages.pools.tensors.values():
            twin.view(torch.uint8).fill_(SENTINEL)
    second = [
        first[0] + [9],  # 49 tokens: decode holds all 3 pages it loads, nothing is written
        first[1] + [11] * 30,  # decode holds 2 of its 4 loaded pages
        first[2][:50] + [5] * 17,  # 3 held pages, then 1 from prefill
    ]
    held = {}

    def check(side, req_id, start):
        check_loaded_kv(side, req_id, start)
        recv = side.recvs[req_id]
        held[req_id] = recv.block_ids[: recv.num_local_blocks]
        blocks = torch.tensor(held[req_id], dtype=torch.long)
        for rank, connector in enumerate(side.instance.connectors):
            for _, twin, axis, _ in connector._worker.pages._pairs:
                got = twin.index_select(axis, blocks).contiguous().view(torch.uint8)
                assert bool((got == SENTINEL).all()), f"{req_id} rank {rank}: a held page was written"

    reqs = run_pd(prefill, decode, second, on_first_run=check)
    assert_loaded_then_ran_one_token(decode, reqs)
    assert [len(held[reqs[i].request_id]) for i in range(len(second))] == [3, 2, 3]
    assert_all_blocks_returned(prefill, decode)
