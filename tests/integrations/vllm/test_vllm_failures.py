"""vLLM's failure contract through both schedulers, the workers' connectors and real sidecars.

A failed receive is reported in ``finished_recving`` (and ``failed_recving``)
AND its blocks as load errors in the same pass; vLLM's scheduler then applies
``kv_load_failure_policy``: ``fail`` ends the request with an error,
``recompute`` prefills it on decode. The failure comes as soon as pd-transfer
knows: here a pair the sidecars reject (prefill's KV is float32, decode's
float16), with every sidecar timeout set far beyond the test's deadline, so
only the verdict can end the requests in time.
"""

from __future__ import annotations

import logging

import pytest

# a specific module: the directory tests/integrations/vllm/ itself imports as a namespace "vllm"
pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed here: run tests/integrations/vllm with the "
    "python printed by .ci/engine-venv-vllm",
)

import torch  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_traffic import Side, run_pd  # noqa: E402

from pd_transfer.processes.ports import spare_port  # noqa: E402

NUM_BLOCKS = 200
# far beyond run_pd's deadline below: a request ended by a timeout would fail the test
SLOW_TIMEOUTS = {"bootstrap_timeout_s": 900.0, "waiting_timeout_s": 900.0, "transfer_timeout_s": 900.0}
LENGTHS = [17, 40, 33, 2]


def prompt(n: int, seed: int) -> list[int]:
    return [3 + seed] + [3 + (seed * 13 + i * 7) % 250 for i in range(1, n)]


def rejected_pair(instances, model_dir, policy: str):
    bootstrap = f"tcp://127.0.0.1:{spare_port()}"
    prefill = Side(
        instances,
        model_dir,
        "kv_producer",
        1,
        bootstrap,
        16,
        NUM_BLOCKS,
        dtype=torch.float32,
        sidecar=SLOW_TIMEOUTS,
    )
    decode = Side(
        instances,
        model_dir,
        "kv_consumer",
        1,
        bootstrap,
        16,
        NUM_BLOCKS,
        sidecar=SLOW_TIMEOUTS,
        policy=policy,
    )
    return prefill, decode


def test_fail_policy_ends_each_request_of_a_rejected_pair_with_the_verdict(instances, model_dir, caplog):
    prefill, decode = rejected_pair(instances, model_dir, "fail")
    caplog.set_level(logging.ERROR, logger="pd_transfer.integrations.vllm")
    reqs = run_pd(
        prefill,
        decode,
        [prompt(n, i) for i, n in enumerate(LENGTHS)],
        timeout_s=240,
        until_prefill_idle=False,
    )
    for req in reqs.values():
        assert req.status == RequestStatus.FINISHED_ERROR, (len(req.prompt_token_ids), req.status)
        assert req.request_id not in decode.first_runs  # never decoded from KV that did not arrive
        reasons = [r.getMessage() for r in caplog.records if req.request_id in r.getMessage()]
        assert any("peer_rejected" in m and "dtype" in m for m in reasons), reasons
    finished = [o for o in decode.outputs if o.finished]
    assert {o.request_id for o in finished} == {r.request_id for r in reqs.values()}
    assert all(str(o.finish_reason) == "error" for o in finished), [o.finish_reason for o in finished]
    assert decode.num_free_blocks() == decode.free_at_start


def test_recompute_policy_prefills_each_request_of_a_rejected_pair_on_decode(instances, model_dir):
    prefill, decode = rejected_pair(instances, model_dir, "recompute")
    reqs = run_pd(
        prefill,
        decode,
        [prompt(n, i) for i, n in enumerate(LENGTHS)],
        timeout_s=240,
        until_prefill_idle=False,
    )
    for req in reqs.values():
        n = len(req.prompt_token_ids)
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED, (n, req.status)
        assert decode.first_runs[req.request_id] == (0, n)  # computed from the first token, nothing loaded
    assert decode.num_free_blocks() == decode.free_at_start
