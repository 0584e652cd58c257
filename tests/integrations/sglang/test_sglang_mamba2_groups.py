"""Mamba2 conv states with fewer, as many or more B/C groups than TP ranks, built
with SGLang's ``Mamba2StateShape``, ``MambaPool`` and ``HybridLinearKVPool``.

SGLang counts a Mamba2 conv state's channels TP-extended: with ``n_groups``
below the TP size (``n_groups % tp != 0``), ``conv_dim`` holds ``tp`` groups of
B and C (``extra_groups_for_head_shards``) and ``MambaMixer2`` loads the one
group whole on every rank. The oracle is SGLang's own split:
``mamba_v2_sharded_weight_loader`` with the settings ``MambaMixer2`` gives it
(which for ``n_groups % tp == 0`` is the per-output split of its
``MergedColumnParallelLinear``), applied to the model's full conv state. Every
TP pair of 1, 2, 4 and 8 with ``n_groups`` 1, 2 and 8 is registered as the
backend registers it, reconciled, planned, its byte runs copied between the
pools' memory and the landed slot compared with that split. ``n_groups = 1``
also runs through real sidecars (TP 1 -> 2, 2 -> 1), every rank built by
SGLang's real queues through the plugin's hook from a local NemotronH
``config.json``. ``n_groups`` 2 at TP 4 or 8, which ``MambaMixer2``
refuses to build, is refused at start.
"""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape, extra_groups_for_head_shards
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.layers.attention.mamba.mamba import mamba_v2_sharded_weight_loader
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool
from sglang.srt.plugins import load_plugins
from sglang_deployment import Deployment, run_room
from sglang_process import Topology, queue_rank, sglang_rank
from sglang_ranks import SglangRank, fill_kv_args, metadata_buffers

from pd_transfer.errors import GeometryError, Reason
from pd_transfer.integrations.sglang.memory import share_engine_memory
from pd_transfer.integrations.sglang.plugin import engine_facts
from pd_transfer.integrations.sglang.registration import describe_rank
from pd_transfer.layout.fanout import decode_rank_as, decode_ranks_fed
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.planner import PairPlanner
from pd_transfer.layout.reconcile import reconcile
from pd_transfer.layout.views import Pool

KV_HEADS, HEAD_DIM, PAGE_SIZE, POOL_TOKENS = 2, 8, 4, 16
ATTN_LAYERS, MAMBA_LAYERS = [0, 2], [1, 3]
M_HEADS, M_HEAD_DIM, STATE, KERNEL = 8, 2, 4, 4
D_INNER = M_HEADS * M_HEAD_DIM
TPS = (1, 2, 4, 8)
SRC_SLOT, DST_SLOT = 1, 2


def buildable(n_groups: int, tp: int) -> bool:
    """What ``MambaMixer2`` builds: ``n_groups % tp == 0 or n_groups == 1``."""
    return n_groups % tp == 0 or n_groups == 1


def cache_params(tp: int, n_groups: int) -> Mamba2CacheParams:
    shape = Mamba2StateShape.create(
        tp_world_size=tp,
        intermediate_size=D_INNER,
        n_groups=n_groups,
        num_heads=M_HEADS,
        head_dim=M_HEAD_DIM,
        state_size=STATE,
        conv_kernel=KERNEL,
    )
    return Mamba2CacheParams(shape=shape, layers=MAMBA_LAYERS)


def facts(tp: int, n_groups: int, params: Mamba2CacheParams, pool, *, named: bool = True):
    """The plugin's facts, read from a NemotronH-style config (``n_groups``) as the hook reads them."""
    hf_config = SimpleNamespace(n_groups=n_groups) if named else SimpleNamespace()
    model_config = SimpleNamespace(
        hf_config=hf_config, get_total_num_kv_heads=lambda: KV_HEADS, model_path="tiny-nemotron-h"
    )
    return engine_facts(model_config, SimpleNamespace(attn_tp_size=tp, pp_size=1), pool, params)


def pools(tp: int, n_groups: int):
    params = cache_params(tp, n_groups)
    mamba = MambaPool(
        size=4, spec_state_size=0, cache_params=params, mamba_layer_ids=MAMBA_LAYERS, device="cpu"
    )
    pool = HybridLinearKVPool(
        size=POOL_TOKENS,
        dtype=torch.bfloat16,
        page_size=PAGE_SIZE,
        head_num=max(1, KV_HEADS // tp),
        head_dim=HEAD_DIM,
        full_attention_layer_ids=ATTN_LAYERS,
        device="cpu",
        mamba_pool=mamba,
    )
    return params, mamba, pool


def mixer_split(full: torch.Tensor, n_groups: int, tp: int, tp_rank: int) -> torch.Tensor:
    """Rank ``tp_rank``'s conv channels of ``full`` (the model's ``[x | B | C]``), as SGLang loads them."""
    extended = n_groups + extra_groups_for_head_shards(n_groups, tp)
    group = (extended * STATE, (extended - n_groups) * STATE, n_groups == 1)  # MambaMixer2's settings
    local = torch.zeros(((D_INNER + 2 * extended * STATE) // tp,) + tuple(full.shape[1:]), dtype=full.dtype)
    mamba_v2_sharded_weight_loader([(D_INNER, 0, False), group, group], tp, tp_rank)(local, full)
    return local


def model_state(n_groups: int, seed: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per Mamba layer the model's full conv state and temporal state of one request."""
    gen = torch.Generator().manual_seed(seed)
    conv_dim = D_INNER + 2 * n_groups * STATE
    return {
        layer: (
            torch.randn(conv_dim, KERNEL - 1, generator=gen),
            torch.randn(M_HEADS, M_HEAD_DIM, STATE, generator=gen),
        )
        for layer in MAMBA_LAYERS
    }


def fill_slot(mamba, state, n_groups: int, tp: int, tp_rank: int, slot: int) -> None:
    cache = mamba.mamba_cache
    heads = slice(tp_rank * M_HEADS // tp, (tp_rank + 1) * M_HEADS // tp)
    for i, layer in enumerate(MAMBA_LAYERS):
        conv, temporal = state[layer]
        cache.conv[0][i, slot] = mixer_split(conv, n_groups, tp, tp_rank).to(cache.conv[0].dtype)
        cache.temporal[i, slot] = temporal[heads].to(cache.temporal.dtype)


def check_slot(mamba, state, n_groups: int, tp: int, tp_rank: int, slot: int) -> None:
    cache = mamba.mamba_cache
    heads = slice(tp_rank * M_HEADS // tp, (tp_rank + 1) * M_HEADS // tp)
    for i, layer in enumerate(MAMBA_LAYERS):
        conv, temporal = state[layer]
        want = mixer_split(conv, n_groups, tp, tp_rank).to(cache.conv[0].dtype)
        assert torch.equal(cache.conv[0][i, slot], want), f"conv layer {layer} rank {tp_rank}/{tp}"
        assert torch.equal(cache.temporal[i, slot], temporal[heads].to(cache.temporal.dtype))
        others = [s for s in range(cache.conv[0].shape[1]) if s != slot]
        assert not cache.conv[0][i, others].any(), "a slot the room did not name was written"


class Side:
    """One instance's ranks registered as the backend registers them (no sidecar)."""

    def __init__(self, role: Role, tp: int, n_groups: int, tag: str) -> None:
        self.tp, self.ranks, self.geometries, self.memories = tp, [], [], []
        try:
            for tp_rank in range(tp):
                params, mamba, pool = pools(tp, n_groups)
                rank = SglangRank(role.value, tp_rank, pool, metadata_buffers(), None, mamba)
                memory = share_engine_memory(
                    f"{tag}-{role.value}{tp_rank}",
                    kv_pool=pool,
                    metadata_buffers=rank.metadata,
                    mamba_pool=mamba,
                )
                self.memories.append(memory)
                rank_facts = facts(tp, n_groups, params, pool)
                kv_args = fill_kv_args(rank, page_size=PAGE_SIZE, num_layers=4, total_kv_heads=KV_HEADS)
                self.geometries.append(describe_rank(kv_args, memory, rank_facts, role))
                self.ranks.append(rank)
        except BaseException:
            self.close()
            raise

    def region_bytes(self, tp_rank: int) -> dict[str, np.ndarray]:
        return {
            e.region: torch.empty(0, dtype=torch.uint8).set_(e.tensor.untyped_storage()).numpy()
            for e in self.memories[tp_rank].tensors
        }

    def close(self) -> None:
        for memory in self.memories:
            memory.close()


PAIRS = [(n, p, d) for n in (1, 2, 8) for p, d in itertools.product(TPS, TPS)]


@pytest.mark.parametrize(("n_groups", "prefill_tp", "decode_tp"), PAIRS)
def test_every_tp_pair_lands_sglang_mixer_split(n_groups, prefill_tp, decode_tp, monkeypatch):
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)  # the loader's CPU padding path
    tag = f"mg{n_groups}-{prefill_tp}-{decode_tp}"
    if not (buildable(n_groups, prefill_tp) and buildable(n_groups, decode_tp)):
        tp = prefill_tp if not buildable(n_groups, prefill_tp) else decode_tp
        with pytest.raises(GeometryError) as refused:
            Side(Role.PREFILL, tp, n_groups, tag).close()
        assert refused.value.code is Reason.LAYOUT_UNSUPPORTED
        assert f"n_groups={n_groups} over attn_tp_size {tp}" in str(refused.value)
        assert "MambaMixer2" in str(refused.value)
        return
    prefill = Side(Role.PREFILL, prefill_tp, n_groups, tag)
    decode = None
    try:
        decode = Side(Role.DECODE, decode_tp, n_groups, tag)
        state = model_state(n_groups, seed=prefill_tp * 10 + decode_tp)
        for r, rank in enumerate(prefill.ranks):
            fill_slot(rank.mamba_pool, state, n_groups, prefill_tp, r, SRC_SLOT)
        verdict = reconcile(prefill.geometries, decode.geometries)
        assert not verdict.mismatches, str(verdict.error())
        requests = {Pool.MAMBA: (np.array([SRC_SLOT]), np.array([DST_SLOT]))}
        for d, dst in enumerate(decode.geometries):
            dst_bytes = decode.region_bytes(d)
            for p, src in enumerate(prefill.geometries):
                src_bytes = prefill.region_bytes(p)
                for src_region, dst_region, so, do, nb in (
                    PairPlanner(verdict, src, dst).plan(requests).byte_runs()
                ):
                    for s, t, n in zip(so.tolist(), do.tolist(), nb.tolist()):
                        dst_bytes[dst_region][t : t + n] = src_bytes[src_region][s : s + n]
        for d, rank in enumerate(decode.ranks):
            check_slot(rank.mamba_pool, state, n_groups, decode_tp, d, DST_SLOT)
    finally:
        prefill.close()
        if decode is not None:
            decode.close()


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 8), (4, 2)])
def test_one_decode_rank_stands_for_its_instance_with_replicated_groups(prefill_tp, decode_tp):
    # a prefill sidecar learns the decode ranks it feeds from one registration (layout/fanout.py)
    prefill = Side(Role.PREFILL, prefill_tp, 1, f"fan-{prefill_tp}{decode_tp}")
    decode = None
    try:
        decode = Side(Role.DECODE, decode_tp, 1, f"fan-{prefill_tp}{decode_tp}")
        full = reconcile(prefill.geometries, decode.geometries)
        for template in decode.geometries:
            for rank in decode.geometries:
                assert decode_rank_as(template, rank.tp_rank).views == rank.views
            single = reconcile(prefill.geometries, [template])
            for src in prefill.geometries:
                want = [d.tp_rank for d in decode.geometries if src.rank_id in full.sources_for(d)]
                assert decode_ranks_fed(single, src.rank_id, template) == want
    finally:
        prefill.close()
        if decode is not None:
            decode.close()


def test_group_count_a_config_does_not_name_is_refused_where_ambiguous(monkeypatch):
    # 2 groups held over TP 2: n_groups=2 sliced, or n_groups=1 replicated; nothing tells which
    params, _, pool = pools(2, 1)
    with pytest.raises(GeometryError) as refused:
        facts(2, 1, params, pool, named=False)
    assert refused.value.code is Reason.LAYOUT_UNSUPPORTED
    assert "n_groups" in str(refused.value) and "config.json" in (refused.value.hint or "")
    params, _, pool = pools(1, 1)  # TP 1: one layout either way
    assert facts(1, 1, params, pool, named=False).mamba2_conv_groups.groups == (D_INNER, STATE, STATE)


def nemotron_h_dir(root, n_groups: int) -> str:
    """A local NemotronH ``config.json`` with ``n_groups`` B/C groups (no weights)."""
    path = root / f"tiny-nemotron-h-g{n_groups}"
    path.mkdir(exist_ok=True)
    config = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hybrid_override_pattern": "*M*M",  # attention on layers 0, 2; Mamba2 on 1, 3
        "mamba_num_heads": M_HEADS,
        "mamba_head_dim": M_HEAD_DIM,
        "n_groups": n_groups,
        "ssm_state_size": STATE,
        "conv_kernel": KERNEL,
        "vocab_size": 128,
        "max_position_embeddings": 256,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def sidecar_rank(role, tp_rank, tp, deployment, monkeypatch, model_dir):
    """SGLang's queue over pools sized by its ``NemotronHConfig`` at TP ``tp``, through the
    plugin's hook (which reads ``n_groups`` and the cache params from that config)."""
    monkeypatch.setenv("PD_TRANSFER_SGLANG_WORKER_ENDPOINT", deployment.endpoint(role, tp_rank))
    with sglang_rank(role, Topology(tp), tp_rank, model_path=model_dir):
        params = ModelConfig(model_dir).hf_config.mamba2_cache_params
    assert params.layers == MAMBA_LAYERS
    mamba = MambaPool(
        size=4, spec_state_size=0, cache_params=params, mamba_layer_ids=MAMBA_LAYERS, device="cpu"
    )
    pool = HybridLinearKVPool(
        size=POOL_TOKENS,
        dtype=torch.bfloat16,
        page_size=PAGE_SIZE,
        head_num=max(1, KV_HEADS // tp),
        head_dim=HEAD_DIM,
        full_attention_layer_ids=ATTN_LAYERS,
        device="cpu",
        mamba_pool=mamba,
    )
    rank = queue_rank(role, Topology(tp), tp_rank, model_dir, pool=pool, metadata=metadata_buffers())
    rank.mamba_pool = mamba
    return rank


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1)])
def test_one_group_replicated_moves_through_sidecars(tmp_path, monkeypatch, prefill_tp, decode_tp):
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    load_plugins()
    model_dir = nemotron_h_dir(tmp_path, 1)
    deployment = Deployment(tmp_path, prefill_tp, decode_tp)
    prefill = decode = []
    try:
        prefill = [
            sidecar_rank("prefill", r, prefill_tp, deployment, monkeypatch, model_dir)
            for r in range(prefill_tp)
        ]
        decode = [
            sidecar_rank("decode", r, decode_tp, deployment, monkeypatch, model_dir) for r in range(decode_tp)
        ]
        state = model_state(1, seed=5)
        for rank in prefill:
            fill_slot(rank.mamba_pool, state, 1, prefill_tp, rank.tp_rank, SRC_SLOT)
        p_states, d_states, _, receivers = run_room(
            prefill,
            decode,
            deployment,
            91,
            [1, 2],
            [2, 3],
            src_aux=0,
            dst_aux=1,
            src_state=[np.array([SRC_SLOT])],
            dst_state=[np.array([DST_SLOT])],
        )
        assert d_states == [KVPoll.Success] * decode_tp, [r.failure for r in receivers]
        assert p_states == [KVPoll.Success] * prefill_tp
        for rank in decode:
            check_slot(rank.mamba_pool, state, 1, decode_tp, rank.tp_rank, DST_SLOT)
    finally:
        for rank in prefill + decode:
            rank.close()
        deployment.close()
