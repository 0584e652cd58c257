"""Cross-engine: an SGLang-shaped prefill (TP 2) and a vLLM decode (TP 4) of one model, byte-exact.

Two models: a Llama-like GQA model, and a GDN hybrid (full attention on
layers 1, 3, gated delta net on layers 0, 2) whose conv state SGLang keeps as
``(channels, taps)`` per slot and vLLM as ``(taps, channels)`` inside a raw
page shared with the attention group (vllm_hybrid_caches.py).

Prefill is laid out as SGLang's ``MHATokenToKVPool`` keeps it: per layer a
K and a V tensor of ``(token rows, local heads, head_dim)``, all in one
storage, pages of 16 rows; it is described by pd-transfer's SGLang
registration (``describe_rank`` over ``kv_args`` filled as SGLang's
``get_kv_transfer_buf_infos`` fills them; no SGLang import) and sends with
the plain client. Decode is the vLLM connector with tensors shaped as
vLLM's CPU backend registers them (``[blocks, heads, block_size, 2 *
head_size]``, K | V on the last axis). The two layouts differ in every axis
but the page; the sidecars reconcile them. The oracle is the request's
logical KV and state, sliced per rank with plain torch indexing.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed here: run tests/integrations/vllm with the "
    "python printed by .ci/engine-venv-vllm",
)

import time  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402
from cluster import Sidecar  # noqa: E402
from vllm_harness import BLOCK_SIZE  # noqa: E402
from vllm_hybrid_caches import (  # noqa: E402
    ATTN,
    CONV_GROUPS,
    GDN,
    K_DIM,
    KERNEL,
    V_DIM,
    V_HEADS,
    assert_same_bytes,
    flat_copy,
    gdn_hybrid,
    gdn_states,
    heads_of,
    local_channels,
    put_kv,
    twin,
)
from vllm_instances import (  # noqa: E402
    HEAD_SIZE,
    NUM_BLOCKS,
    NUM_LAYERS,
    SIDECAR_CONFIG,
    TOTAL_HEADS,
    assert_bit_equal,
    expected_decode,
    logical_kv,
    rank_heads,
    run_until,
)

from pd_transfer.client import Client  # noqa: E402
from pd_transfer.integrations.sglang.memory import share_engine_memory  # noqa: E402
from pd_transfer.integrations.sglang.registration import EngineFacts, describe_rank  # noqa: E402
from pd_transfer.integrations.vllm.specs import RecvSpec, StepSpecs  # noqa: E402
from pd_transfer.layout.geometry import Role  # noqa: E402
from pd_transfer.ports import spare_port  # noqa: E402


class SglangShapedRank:
    """One SGLang-shaped prefill rank: its MHA pool (and GDN ``MambaPool``) in shared memory, registered.

    ``attn_layers``: the model layers of the MHA pool; ``gdn_layers``: those
    of the Mamba pool, whose per-slot conv state is SGLang's
    ``(channels, taps)`` (vLLM's default is ``(taps, channels)``) and
    temporal state ``(v_heads, v_dim, k_dim)``.
    """

    def __init__(
        self,
        sidecar: Sidecar,
        tp_rank: int,
        tp_size: int,
        model: str,
        *,
        attn_layers=tuple(range(NUM_LAYERS)),
        gdn_layers=(),
    ) -> None:
        heads = TOTAL_HEADS // tp_size
        rows = NUM_BLOCKS * BLOCK_SIZE
        n = len(attn_layers)
        storage = torch.zeros(2, n, rows, heads, HEAD_SIZE, dtype=torch.float16)
        pool = SimpleNamespace(
            k_buffer=[storage[0, i] for i in range(n)],
            v_buffer=[storage[1, i] for i in range(n)],
            head_num=heads,
        )
        no_aux = SimpleNamespace(get_buf_infos=lambda: ([], [], []))
        self.pool, self.heads, self.tp = pool, rank_heads(tp_size, tp_rank), (tp_size, tp_rank)
        self.mamba = _gdn_pool(len(gdn_layers), tp_size) if gdn_layers else None
        self.memory = share_engine_memory(
            f"sgl-{tp_rank}", kv_pool=pool, metadata_buffers=no_aux, mamba_pool=self.mamba
        )
        buffers = pool.k_buffer + pool.v_buffer  # SGLang's order: every K, then every V
        kv_args = SimpleNamespace(
            engine_rank=tp_rank,
            pp_rank=0,
            page_size=BLOCK_SIZE,
            num_draft_entries=0,
            kv_data_ptrs=[b.data_ptr() for b in buffers],
            kv_data_lens=[b.nbytes for b in buffers],
            kv_item_lens=[b[0].nbytes * BLOCK_SIZE for b in buffers],
            kv_layer_ids=list(attn_layers) * 2,
            kv_head_num=heads,
            state_types=None,
            aux_data_ptrs=[],
            aux_data_lens=[],
            aux_item_lens=[],
        )
        if self.mamba is not None:
            _gdn_kv_args(kv_args, self.mamba.mamba_cache, list(gdn_layers))
        facts = EngineFacts(attn_tp_size=tp_size, total_kv_heads=TOTAL_HEADS, model=model)
        self.geometry = describe_rank(kv_args, self.memory, facts, Role.PREFILL)
        self.client = Client(sidecar.endpoint, f"sglang-prefill-tp{tp_rank}")
        self.client.register(self.geometry, self.memory.handles, timeout_s=60)

    def fill(self, kv: torch.Tensor, pages: list[int]) -> None:
        """kv: [layer, k|v, block, token, head, dim] -> rows ``page * 16 + token`` of every layer."""
        for layer in range(NUM_LAYERS):
            for which, buffers in enumerate((self.pool.k_buffer, self.pool.v_buffer)):
                for page in pages:
                    rows = slice(page * BLOCK_SIZE, (page + 1) * BLOCK_SIZE)
                    buffers[layer][rows] = kv[layer, which, page][:, self.heads]

    def close(self) -> None:
        self.client.close()
        self.memory.close()


def _gdn_pool(num_layers: int, tp_size: int) -> SimpleNamespace:
    """SGLang's ``MambaPool.mamba_cache`` shapes: conv [layer, slot, channels, taps], temporal [layer, slot, ...]."""
    channels = sum(CONV_GROUPS) // tp_size
    conv = torch.zeros(num_layers, NUM_BLOCKS, channels, KERNEL - 1, dtype=torch.float16)
    temporal = torch.zeros(num_layers, NUM_BLOCKS, V_HEADS // tp_size, V_DIM, K_DIM, dtype=torch.float32)
    return SimpleNamespace(mamba_cache=SimpleNamespace(conv=[conv], temporal=temporal))


def _gdn_kv_args(kv_args: SimpleNamespace, cache: SimpleNamespace, layers: list[int]) -> None:
    """The state entries SGLang's kv_args carry for a GDN pool: every layer's conv, then its temporal."""
    conv, temporal = cache.conv[0], cache.temporal
    tensors = [conv[i] for i in range(len(layers))] + [temporal[i] for i in range(len(layers))]
    kv_args.state_types = ["mamba"]
    kv_args.state_data_ptrs = [[t.data_ptr() for t in tensors]]
    kv_args.state_data_lens = [[t.nbytes for t in tensors]]
    kv_args.state_item_lens = [[t[0].nbytes for t in tensors]]
    kv_args.state_layer_ids = [layers * 2]
    kv_args.state_dim_per_tensor = [[conv.shape[2]] * len(layers) + [temporal.shape[2]] * len(layers)]
    kv_args.state_conv_shard_groups = [[list(CONV_GROUPS)] * len(layers) + [None] * len(layers)]


def test_sglang_shaped_prefill_to_vllm_decode_lands_byte_exact(instances, workdir, model_dir):
    bootstrap = f"tcp://127.0.0.1:{spare_port()}"
    decode = instances("kv_consumer", 4, bootstrap)
    sidecars = [Sidecar(workdir, "prefill", f"sgl2-{r}", dict(SIDECAR_CONFIG), bootstrap) for r in range(2)]
    ranks = []
    try:
        for sidecar in sidecars:
            sidecar.wait_ready(timeout_s=120)
        ranks = [SglangShapedRank(s, r, 2, str(model_dir)) for r, s in enumerate(sidecars)]
        kv = logical_kv(seed=26)
        src, dst = [4, 0, 9], [7, 2, 10]
        for rank in ranks:
            rank.fill(kv, src)
        before = [{n: t.clone() for n, t in caches.items()} for caches in decode.caches]
        decode.start(StepSpecs(recvs=[RecvSpec("req-x", 84, bootstrap, tuple(dst))]))
        for rank in ranks:
            rank.client.send(84, src, last_chunk=True)
        done = [False] * len(decode.connectors)

        def finished() -> bool:
            for i, connector in enumerate(decode.connectors):
                got = connector.get_transfer_results(set())
                assert not got.failed_recving, connector._worker.failures
                done[i] = done[i] or "req-x" in got.finished_recving
            return all(done)

        logs = lambda: decode.logs() + "".join(s.log.read_text()[-2000:] for s in sidecars)  # noqa: E731
        run_until(finished, 90, "the cross-engine room", logs)
        deadline = time.monotonic() + 30
        while not all(rank.client.poll(84).succeeded for rank in ranks):
            assert time.monotonic() < deadline, [rank.client.poll(84).describe() for rank in ranks]
            time.sleep(0.05)
        for rank, want in enumerate(expected_decode(decode, before, kv, src, dst)):
            assert_bit_equal(decode.caches[rank], want, f"vLLM decode tp{rank}/4")
    finally:
        for rank in ranks:
            rank.close()
        for sidecar in sidecars:
            sidecar.terminate()
        for sidecar in sidecars:
            sidecar.wait_stopped()


def test_sglang_shaped_gdn_hybrid_prefill_to_vllm_decode_lands_byte_exact(instances, workdir, model_dir):
    bootstrap = f"tcp://127.0.0.1:{spare_port()}"
    decode = instances("kv_consumer", 4, bootstrap, build=gdn_hybrid)
    sidecars = [Sidecar(workdir, "prefill", f"sgh2-{r}", dict(SIDECAR_CONFIG), bootstrap) for r in range(2)]
    ranks = []
    try:
        for sidecar in sidecars:
            sidecar.wait_ready(timeout_s=120)
        ranks = [
            SglangShapedRank(s, r, 2, str(model_dir), attn_layers=(1, 3), gdn_layers=(0, 2))
            for r, s in enumerate(sidecars)
        ]
        gen = torch.Generator().manual_seed(27)
        src, dst, src_slot, dst_slot = [3, 7], [5, 0], 9, 2
        kv = torch.randn(2, 2, NUM_BLOCKS, BLOCK_SIZE, TOTAL_HEADS, HEAD_SIZE, generator=gen).half()
        conv = torch.randn(2, KERNEL - 1, sum(CONV_GROUPS), generator=gen).half()  # [layer, tap, channel]
        temporal = torch.randn(2, V_HEADS, V_DIM, K_DIM, generator=gen)
        for rank in ranks:
            rank.fill(kv, src)
            tp_size, tp_rank = rank.tp
            cache = rank.mamba.mamba_cache
            for i in range(2):
                cache.conv[0][i, src_slot] = conv[i][:, local_channels(tp_size, tp_rank)].T
                cache.temporal[i, src_slot] = temporal[i][heads_of(tp_size, tp_rank, V_HEADS)]
        expected = []
        for tp_rank, caches in enumerate(decode.caches):
            flat = flat_copy(caches)
            want = twin(caches, flat)
            for i, name in enumerate(ATTN):
                put_kv(want[name], kv[i][:, src], dst, heads_of(4, tp_rank, TOTAL_HEADS))
            for i, name in enumerate(GDN):
                c, t = gdn_states(want[name], 4)
                c[dst_slot] = conv[i][:, local_channels(4, tp_rank)]
                t[dst_slot] = temporal[i][heads_of(4, tp_rank, V_HEADS)]
            expected.append(flat)
        decode.start(
            StepSpecs(recvs=[RecvSpec("req-xh", 85, bootstrap, tuple(dst), state_slots=(dst_slot,))])
        )
        for rank in ranks:
            rank.client.send(85, src, state_slots=[src_slot], last_chunk=True)
        _wait_received(decode, "req-xh", sidecars)
        for tp_rank, caches in enumerate(decode.caches):
            assert_same_bytes(flat_copy(caches), expected[tp_rank], f"vLLM decode tp{tp_rank}/4")
    finally:
        for rank in ranks:
            rank.close()
        for sidecar in sidecars:
            sidecar.terminate()
        for sidecar in sidecars:
            sidecar.wait_stopped()


def _wait_received(decode, req_id: str, sidecars) -> None:
    done = [False] * len(decode.connectors)

    def finished() -> bool:
        for i, connector in enumerate(decode.connectors):
            got = connector.get_transfer_results(set())
            assert not got.failed_recving, connector._worker.failures
            done[i] = done[i] or req_id in got.finished_recving
        return all(done)

    run_until(
        finished,
        90,
        f"{req_id} on decode",
        lambda: decode.logs() + "".join(s.log.read_text()[-2000:] for s in sidecars),
    )
