"""One request through BOTH vLLM schedulers and their workers' connectors, over real sidecars.

Prefill (TP 2) and decode (TP 4) each run vLLM 0.33's real ``Scheduler``
with the connector; every step, the scheduler's connector metadata goes to
each rank's worker connector (as vLLM's model runner passes it, with a
``save_kv_layer`` per layer and ``wait_for_save`` around the pass), and the
workers' reports come back in the model-runner output, ANDed over the ranks
as vLLM's output aggregator does. The model's forward pass is the one thing
played by the test: it writes a known KV into the blocks prefill's scheduler
allocated. At the end decode's blocks hold prefill's KV, byte for byte, and
decode computes only the last prompt token.
"""

from __future__ import annotations

import pytest

# a specific module: the directory tests/integrations/vllm/ itself imports as a namespace "vllm"
pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed here: run tests/integrations/vllm with the "
    "python printed by .ci/engine-venv-vllm",
)

from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_harness import block_ids, request, runner_output, scheduler, vllm_config  # noqa: E402
from vllm_instances import (  # noqa: E402
    LAYERS,
    NUM_BLOCKS,
    assert_bit_equal,
    expected_decode,
    fill_prefill,
    logical_kv,
    run_until,
)

from pd_transfer.processes.ports import spare_port  # noqa: E402


class Engine:
    """A scheduler and its instance's worker connectors, stepped together."""

    def __init__(self, sched, instance) -> None:
        self.sched, self.instance = sched, instance
        self.reports: dict[str, set] = {"sending": set(), "recving": set()}
        self._seen = [{"sending": set(), "recving": set()} for _ in instance.connectors]

    def step(self, running=()):
        out = self.sched.schedule()
        meta = out.kv_connector_metadata
        errors = set()
        for rank, connector in enumerate(self.instance.connectors):
            connector.bind_connector_metadata(meta)
            connector.start_load_kv(None)
            for name in LAYERS:  # the forward pass, layer by layer
                connector.save_kv_layer(name, None, None)
            connector.wait_for_save()
            results = connector.get_transfer_results(out.finished_req_ids)
            errors |= connector.get_block_ids_with_load_errors()
            connector.clear_connector_metadata()
            self._seen[rank]["sending"] |= results.finished_sending
            self._seen[rank]["recving"] |= results.finished_recving
        report = {}
        for kind in ("sending", "recving"):  # finished once EVERY rank reported it
            done = set.intersection(*(seen[kind] for seen in self._seen)) - self.reports[kind]
            self.reports[kind] |= done
            report[f"finished_{kind}"] = done
        engine_outputs = self.sched.update_from_output(
            out,
            runner_output(
                [r for r in running if r.request_id in out.num_scheduled_tokens],
                invalid_block_ids=errors,
                **report,
            ),
        )
        return out, [o for outs in engine_outputs.values() for o in outs.outputs]


def test_a_request_prefilled_on_tp2_decodes_on_tp4_from_prefills_kv(instances, model_dir):
    bootstrap = f"tcp://127.0.0.1:{spare_port()}"
    prefill = Engine(
        scheduler(
            vllm_config(model_dir, kv_role="kv_producer", extra={"bootstrap_addr": bootstrap}),
            num_blocks=NUM_BLOCKS,
        ),
        instances("kv_producer", 2, bootstrap),
    )
    decode = Engine(
        scheduler(vllm_config(model_dir, kv_role="kv_consumer"), num_blocks=NUM_BLOCKS),
        instances("kv_consumer", 4, bootstrap),
    )
    kv = logical_kv(seed=24)
    before = [{n: t.clone() for n, t in caches.items()} for caches in decode.instance.caches]

    # prefill: the forward pass writes the prompt's KV, the request stops at its one token
    first = request(40, kv_transfer_params={"do_remote_decode": True}, max_tokens=1)
    prefill.sched.add_request(first)
    fill_prefill(prefill.instance, kv)
    _, outputs = prefill.step([first])
    src = block_ids(prefill.sched, first.request_id)
    (finished,) = [o for o in outputs if o.request_id == first.request_id]

    # decode: the router forwards prefill's kv_transfer_params with the same prompt
    second = request(40, kv_transfer_params=dict(finished.kv_transfer_params), max_tokens=4)
    second.prompt_token_ids[:] = first.prompt_token_ids
    decode.sched.add_request(second)

    def both_step() -> bool:
        prefill.step()
        out, _ = decode.step([second])
        return second.request_id in out.num_scheduled_tokens

    run_until(
        both_step, 120, "decode to run the request", lambda: prefill.instance.logs() + decode.instance.logs()
    )
    assert second.status == RequestStatus.RUNNING and second.num_computed_tokens == 40
    run_until(
        lambda: (prefill.step(), first.request_id in prefill.reports["sending"])[1],
        60,
        "prefill to release its blocks",
        prefill.instance.logs,
    )
    assert first.request_id not in prefill.sched.requests

    dst = block_ids(decode.sched, second.request_id)[: len(src)]
    for rank, want in enumerate(expected_decode(decode.instance, before, kv, src, dst)):
        assert_bit_equal(decode.instance.caches[rank], want, f"decode tp{rank}/4")
