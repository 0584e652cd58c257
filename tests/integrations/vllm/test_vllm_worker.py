"""The connector's worker side with real sidecars: vLLM-shaped KV caches moved byte-exact across TP sizes.

See vllm_instances.py for the ranks (real connectors, vLLM-shaped tensors,
real sidecars) and the oracle.
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
from vllm_harness import BLOCK_SIZE  # noqa: E402
from vllm_instances import (  # noqa: E402
    LATENT,
    LAYERS,
    NUM_BLOCKS,
    NUM_LAYERS,
    Instance,
    assert_bit_equal,
    expected_decode,
    fill_prefill,
    logical_kv,
    run_until,
)
from vllm_instances import transfer as transfer_specs  # noqa: E402

from pd_transfer.integrations.vllm.specs import RecvSpec, SendSpec, StepSpecs  # noqa: E402
from pd_transfer.processes.ports import spare_port  # noqa: E402


def transfer(prefill: Instance, decode: Instance, req: str, room: int, src: list[int], dst: list[int]):
    return transfer_specs(
        prefill, decode, SendSpec(req, room, tuple(src)), RecvSpec(req, room, prefill.bootstrap, tuple(dst))
    )


def _bootstrap():
    return f"tcp://127.0.0.1:{spare_port()}"


@pytest.mark.parametrize(("tp_prefill", "tp_decode"), [(2, 4), (4, 2)])
def test_kv_moves_byte_exact_across_tp_sizes(instances, tp_prefill, tp_decode):
    bootstrap = _bootstrap()
    prefill = instances("kv_producer", tp_prefill, bootstrap)
    decode = instances("kv_consumer", tp_decode, bootstrap)
    kv = logical_kv(seed=tp_prefill * 10 + tp_decode)
    fill_prefill(prefill, kv)
    before = [{n: t.clone() for n, t in caches.items()} for caches in decode.caches]
    src, dst = [3, 7, 1], [5, 0, 9]
    results, errors = transfer(prefill, decode, "req-1", 77, src, dst)
    assert all(not r.failed_recving for r in results) and all(not e for e in errors)
    for rank, want in enumerate(expected_decode(decode, before, kv, src, dst)):
        assert_bit_equal(decode.caches[rank], want, f"decode tp{rank}/{tp_decode}")


def test_mla_latent_moves_byte_exact_from_tp4_to_tp2(instances):
    bootstrap = _bootstrap()
    prefill = instances("kv_producer", 4, bootstrap, mla=True)
    decode = instances("kv_consumer", 2, bootstrap, mla=True)
    latent = torch.randn(
        NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, LATENT, generator=torch.Generator().manual_seed(5)
    ).half()
    for caches in prefill.caches:  # replicated: every prefill rank holds the same latent
        for layer, name in enumerate(LAYERS):
            caches[name].copy_(latent[layer])
    before = [{n: t.clone() for n, t in caches.items()} for caches in decode.caches]
    src, dst = [2, 11], [4, 6]
    results, errors = transfer(prefill, decode, "req-mla", 78, src, dst)
    assert all(not r.failed_recving for r in results) and all(not e for e in errors)
    for rank, caches in enumerate(decode.caches):
        want = {n: t.clone() for n, t in before[rank].items()}
        for layer, name in enumerate(LAYERS):
            want[name][dst] = latent[layer][src]
        assert_bit_equal(caches, want, f"decode tp{rank}/2")


def test_a_room_nobody_sends_is_reported_finished_failed_with_its_blocks(instances):
    bootstrap = _bootstrap()
    instances("kv_producer", 1, bootstrap)  # a prefill that never sends the room
    decode = instances("kv_consumer", 1, bootstrap, config={"waiting_timeout_s": 2.0})
    connector = decode.connectors[0]
    before = {n: t.clone() for n, t in decode.caches[0].items()}
    decode.start(StepSpecs(recvs=[RecvSpec("req-lost", 79, bootstrap, (1, 2, 3))]))
    got, errors = [], set()

    def step():
        results = connector.get_transfer_results(set())
        errors.update(connector.get_block_ids_with_load_errors())
        got.append(results)
        return "req-lost" in results.finished_recving

    run_until(step, 60, "the lost room to fail", decode.logs)
    assert "req-lost" in got[-1].failed_recving
    assert errors == {1, 2, 3}  # reported in the same pass as the finish
    assert_bit_equal(decode.caches[0], before, "decode")  # nothing unstaged from a failed room
    assert "req-lost" in connector._worker.failures


def test_bad_params_fail_the_request_at_once_with_the_reason(instances):
    decode = instances("kv_consumer", 1, _bootstrap())
    connector = decode.connectors[0]
    decode.start(StepSpecs(recvs=[RecvSpec("req-bad", 0, "", (4, 5), error="room is 'x'")]))
    results = connector.get_transfer_results(set())
    assert results.finished_recving == {"req-bad"} == results.failed_recving
    assert connector.get_block_ids_with_load_errors() == {4, 5}
    assert connector._worker.failures["req-bad"] == "room is 'x'"


def test_a_streamed_send_hands_each_layer_over_as_vllm_saves_it(instances):
    bootstrap = _bootstrap()
    prefill = instances("kv_producer", 1, bootstrap)
    decode = instances("kv_consumer", 2, bootstrap)
    kv = logical_kv(seed=31)
    fill_prefill(prefill, kv)
    late = prefill.caches[0][LAYERS[1]].clone()
    prefill.caches[0][LAYERS[1]].zero_()  # layer 1 is not computed yet
    before = [{n: t.clone() for n, t in caches.items()} for caches in decode.caches]
    want = expected_decode(decode, before, kv, [2, 5], [8, 1])
    src, dst = (2, 5), (8, 1)
    for connector in decode.connectors:  # a sentinel where layer 1 will land
        connector._worker.pages._pairs[1][1][list(dst)] = 7.0
    decode.start(StepSpecs(recvs=[RecvSpec("req-s", 83, bootstrap, dst)]))
    prefill.start(StepSpecs(sends=[SendSpec("req-s", 83, src, stream=True)]))
    (sender,) = prefill.connectors

    def landed(layer: int) -> list[bool]:
        """Per decode rank: layer ``layer``'s blocks in the sidecar-written shared memory are prefill's."""
        out = []
        for rank, connector in enumerate(decode.connectors):
            twin = connector._worker.pages._pairs[layer][1]
            out.append(
                torch.equal(
                    twin[list(dst)].view(torch.int16), want[rank][LAYERS[layer]][list(dst)].view(torch.int16)
                )
            )
        return out

    sender.save_kv_layer(LAYERS[0], None, None)  # the forward pass wrote layer 0
    run_until(lambda: all(landed(0)), 60, "layer 0 to land", lambda: prefill.logs() + decode.logs())
    for connector in decode.connectors:
        assert bool((connector._worker.pages._pairs[1][1][list(dst)] == 7.0).all()), (
            "layer 1 moved before it was announced"
        )
    assert all("req-s" not in c.get_transfer_results(set()).finished_recving for c in decode.connectors)

    prefill.caches[0][LAYERS[1]].copy_(late)  # the forward pass writes layer 1, then saves it
    sender.save_kv_layer(LAYERS[1], None, None)
    sender.wait_for_save()
    done = [False] * len(decode.connectors)

    def finished() -> bool:
        for i, c in enumerate(decode.connectors):
            got = c.get_transfer_results(set())
            assert not got.failed_recving, c._worker.failures
            done[i] = done[i] or "req-s" in got.finished_recving
        return all(done)

    run_until(finished, 60, "the streamed room", lambda: prefill.logs() + decode.logs())
    for rank, caches in enumerate(decode.caches):
        assert_bit_equal(caches, want[rank], f"decode tp{rank}/2")
