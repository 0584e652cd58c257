"""vLLM instances' worker connectors on real sidecars, and an oracle for their KV, for the connector tests.

Each rank is a real ``PdTransferConnector`` (role WORKER) given tensors shaped
exactly as vLLM's CPU backend hands them to ``register_kv_caches``: every
layer a ``[blocks, heads, block_size, 2 * head_size]`` view (K | V on the
last axis) into ONE storage shared by all layers. Real sidecar processes talk
over 127.0.0.1; the connector stages pages through shared memory. The oracle
is independent of pd-transfer's views: a logical K/V per layer, sliced by
head with plain torch indexing, compared bit for bit.
Imported only by test modules that already skipped without vLLM.
"""

from __future__ import annotations

import time

import torch
from cluster import Sidecar
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm_harness import BLOCK_SIZE, attention_cache_config, vllm_config

from pd_transfer.integrations.vllm.connector import PdTransferConnector, PdTransferConnectorMetadata
from pd_transfer.integrations.vllm.specs import RecvSpec, SendSpec, StepSpecs

NUM_LAYERS, NUM_BLOCKS, TOTAL_HEADS, HEAD_SIZE, LATENT = 2, 12, 4, 16, 24
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
SIDECAR_CONFIG = {
    "transport": "shm",
    "http_port": 0,
    "heartbeat_interval_s": 0.2,
    "heartbeat_misses": 5,
    "bootstrap_timeout_s": 20.0,
    "waiting_timeout_s": 30.0,
    "transfer_timeout_s": 30.0,
    "abort_drain_timeout_s": 3.0,
}


class Instance:
    """One vLLM instance's worker connectors (one per TP rank), each with its own sidecar."""

    def __init__(
        self,
        workdir,
        model_dir,
        role: str,
        tp_size: int,
        bootstrap: str,
        *,
        mla=False,
        config=None,
        build=None,
    ) -> None:
        """``build(tp_size, rank)``: (KVCacheConfig, kv_caches) of a rank; default: the Llama layers."""
        self.role, self.tp_size, self.mla, self.bootstrap = role, tp_size, mla, bootstrap
        pd_role = "prefill" if role == "kv_producer" else "decode"
        self.sidecars = [
            Sidecar(
                workdir,
                pd_role,
                f"{pd_role[:3]}{tp_size}-{r}",
                {**SIDECAR_CONFIG, **(config or {})},
                bootstrap if pd_role == "prefill" else "",
            )
            for r in range(tp_size)
        ]
        self.connectors, self.caches = [], []
        try:
            for sidecar in self.sidecars:
                sidecar.wait_ready(timeout_s=120)
            for rank, sidecar in enumerate(self.sidecars):
                heads = 1 if mla else TOTAL_HEADS // tp_size
                config = vllm_config(
                    model_dir,
                    kv_role=role,
                    tp_size=tp_size,
                    rank=rank,
                    extra={"worker_endpoint": sidecar.endpoint},
                )
                if build is None:
                    cache_config = attention_cache_config(
                        LAYERS,
                        num_blocks=NUM_BLOCKS,
                        num_kv_heads=heads,
                        head_size=LATENT if mla else HEAD_SIZE,
                        mla=mla,
                    )
                    caches = vllm_shaped_caches(heads, mla)
                else:
                    cache_config, caches = build(tp_size, rank)
                connector = PdTransferConnector(config, KVConnectorRole.WORKER, cache_config)
                connector.register_kv_caches(caches)
                self.connectors.append(connector)
                self.caches.append(caches)
        except BaseException:
            self.close()
            raise

    def start(self, step: StepSpecs) -> None:
        for connector in self.connectors:
            connector.bind_connector_metadata(PdTransferConnectorMetadata(step))
            connector.start_load_kv(None)
            connector.clear_connector_metadata()

    def close(self) -> None:
        for connector in self.connectors:
            connector.shutdown()
        for sidecar in self.sidecars:
            sidecar.terminate()
        for sidecar in self.sidecars:
            sidecar.wait_stopped()

    def logs(self) -> str:
        return "\n".join(f"== {s.name}\n{s.log.read_text()[-2000:]}" for s in self.sidecars)


def vllm_shaped_caches(heads: int, mla: bool) -> dict[str, torch.Tensor]:
    """What vLLM's CPU backend registers: every layer a view into ONE storage, at its own offset."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, LATENT) if mla else (NUM_BLOCKS, heads, BLOCK_SIZE, 2 * HEAD_SIZE)
    per_layer = torch.Size(shape).numel()
    storage = torch.randn(NUM_LAYERS * per_layer, generator=torch.Generator().manual_seed(heads)).half()
    return {name: storage[i * per_layer : (i + 1) * per_layer].view(shape) for i, name in enumerate(LAYERS)}


def logical_kv(seed: int) -> torch.Tensor:
    """The model's KV: [layer, k|v, block, token, head, dim] over ALL heads (or [layer, block, token, latent])."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, TOTAL_HEADS, HEAD_SIZE, generator=gen).half()


def rank_heads(tp_size: int, rank: int) -> slice:
    per_rank = TOTAL_HEADS // tp_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def fill_prefill(instance: Instance, kv: torch.Tensor) -> None:
    for rank, caches in enumerate(instance.caches):
        heads = rank_heads(instance.tp_size, rank)
        for layer, name in enumerate(LAYERS):
            t = caches[name]  # [block, head, token, 2 * dim]; kv: [k|v, block, token, head, dim]
            t[..., :HEAD_SIZE] = kv[layer, 0][:, :, heads].permute(0, 2, 1, 3)
            t[..., HEAD_SIZE:] = kv[layer, 1][:, :, heads].permute(0, 2, 1, 3)


def expected_decode(
    instance: Instance, before: list[dict], kv: torch.Tensor, src: list[int], dst: list[int]
) -> list[dict]:
    out = []
    for rank, caches in enumerate(before):
        heads = rank_heads(instance.tp_size, rank)
        want = {name: t.clone() for name, t in caches.items()}
        for layer, name in enumerate(LAYERS):
            for s, d in zip(src, dst):
                want[name][d, :, :, :HEAD_SIZE] = kv[layer, 0, s][:, heads].permute(1, 0, 2)
                want[name][d, :, :, HEAD_SIZE:] = kv[layer, 1, s][:, heads].permute(1, 0, 2)
        out.append(want)
    return out


def assert_bit_equal(got: dict, want: dict, where: str) -> None:
    for name in LAYERS:
        g, w = got[name].view(torch.int16), want[name].view(torch.int16)
        bad = (g != w).nonzero()
        assert bad.numel() == 0, f"{where} {name}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}"


def transfer(prefill: Instance, decode: Instance, send: SendSpec, recv: RecvSpec, forward=None):
    """Drive one request through both instances' worker connectors, as vLLM steps them.

    ``forward()``: the streamed step's forward pass, run between the send and ``wait_for_save``.
    """
    req = send.req_id
    decode.start(StepSpecs(recvs=[recv]))
    prefill.start(StepSpecs(sends=[send]))
    if forward is not None:
        forward()
    if send.stream:  # the step's forward pass ran: vLLM calls wait_for_save, the layers are announced
        for connector in prefill.connectors:
            connector.wait_for_save()
    sent = [False] * len(prefill.connectors)
    results = [None] * len(decode.connectors)
    errors = [set() for _ in decode.connectors]

    def step() -> bool:
        for i, c in enumerate(prefill.connectors):
            sent[i] = sent[i] or req in c.get_transfer_results({req}).finished_sending
        for i, c in enumerate(decode.connectors):
            if results[i] is None:
                got = c.get_transfer_results(set())
                errors[i] |= c.get_block_ids_with_load_errors()
                if recv.req_id in got.finished_recving:
                    results[i] = got
        return all(sent) and all(r is not None for r in results)

    run_until(step, 90, f"room {send.room}", lambda: prefill.logs() + decode.logs())
    return results, errors


def run_until(predicate, timeout_s: float, what: str, logs) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{logs()}")
        time.sleep(0.05)
