"""What SGLang asks of the backend that it does not serve is refused at start, by
name, and a start that fails leaves no shared memory behind.

The plugin's queue hook (``_init_kv_manager``) runs with SGLang's own pools,
``MetadataBuffers``, disaggregation settings (``Disagg``) and queue class
(``DecodePreallocQueue``); the refusals are checked before any pool moves into
``/dev/shm``, and a failure after the move (the model's facts, or the
registration with a sidecar that is not there) unlinks every segment it made.
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.arg_groups.fields.disagg import Disagg
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.disaggregation.base.conn import KVArgs, StateType
from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool, MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang_ranks import SglangRank, fill_kv_args, metadata_buffers

from pd_transfer.client import ClientError
from pd_transfer.errors import ConfigError, GeometryError, PdTransferError, Reason
from pd_transfer.integrations.sglang import plugin
from pd_transfer.integrations.sglang.conn import ENGINE_MEMORY
from pd_transfer.integrations.sglang.facts import EngineFacts
from pd_transfer.integrations.sglang.memory import share_engine_memory
from pd_transfer.integrations.sglang.registration import describe_rank
from pd_transfer.layout.geometry import Role

PAGE = 4


def our_segments() -> set[str]:
    """This process's pd-transfer segments in /dev/shm (the owner names carry the pid)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("pdt-") and f"-{os.getpid()}-" in n}


def mha_pool() -> MHATokenToKVPool:
    return MHATokenToKVPool(
        size=32,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )


def queue(cls: type, pool, server_args, hf_config=None):
    """A queue of SGLang's own class with what its ``_init_kv_manager`` reads set, as its
    constructor sets it (the constructor itself needs a live scheduler and process groups)."""
    q = cls.__new__(cls)
    q.transfer_backend = "pd_transfer"
    q.token_to_kv_pool = pool
    q.metadata_buffers = metadata_buffers()
    q.tp_rank = 0
    q.is_mla_backend = False
    model_config = SimpleNamespace(
        hf_config=hf_config or SimpleNamespace(), get_total_num_kv_heads=lambda: 2, model_path="tiny"
    )
    q.scheduler = SimpleNamespace(model_config=model_config, server_args=server_args, req_to_token_pool=None)
    return q


@pytest.mark.parametrize(
    ("setting", "flag"),
    [
        (
            {"disaggregation_decode_host_receive_threshold": 0.5},
            "--disaggregation-decode-host-receive-threshold",
        ),
        ({"disaggregation_decode_enable_radix_cache": True}, "--disaggregation-decode-enable-radix-cache"),
    ],
)
def test_decode_settings_the_backend_cannot_serve_are_refused_at_start(setting, flag, monkeypatch):
    before = our_segments()
    called = []
    q = queue(DecodePreallocQueue, mha_pool(), Disagg(**setting))
    with pytest.raises(ConfigError) as refused:
        plugin._init_kv_manager(lambda *a, **k: called.append(a), q)
    assert refused.value.code is Reason.LAYOUT_UNSUPPORTED
    assert flag in str(refused.value) and "pd-transfer" in str(refused.value)
    assert called == [] and our_segments() == before  # refused before any pool moved
    # SGLang's defaults, and a prefill queue, go on to SGLang's own _init_kv_manager
    monkeypatch.setattr(plugin, "_parallel", lambda: SimpleNamespace(attn_tp_size=1, pp_size=1))
    started = []
    for cls, settings in ((DecodePreallocQueue, Disagg()), (PrefillBootstrapQueue, Disagg(**setting))):
        plugin._init_kv_manager(
            lambda q: started.append(ENGINE_MEMORY.get()), queue(cls, mha_pool(), settings)
        )
        started.pop()[0].close()  # a started server keeps its pools shared; the test unlinks them


def test_a_start_failing_after_the_pools_moved_leaves_no_segment(monkeypatch, tmp_path):
    # SGLang's real PrefillBootstrapQueue; nobody serves the rank's endpoint, so the registration
    # (after the hook moved the pools and SGLang filled kv_args) times out
    from sglang.srt.plugins import load_plugins
    from sglang_process import Topology, llama_dir, queue_rank

    from pd_transfer.integrations.sglang import memory

    load_plugins()
    model_dir = llama_dir(tmp_path, "tiny", layers=2, kv_heads=2, head_dim=8)
    monkeypatch.setenv("PD_TRANSFER_SGLANG_WORKER_ENDPOINT", f"unix://{tmp_path}/nobody.sock")
    monkeypatch.setenv("PD_TRANSFER_SGLANG_REGISTER_TIMEOUT_S", "2")
    monkeypatch.setenv("PD_TRANSFER_SGLANG_CALL_TIMEOUT_S", "2")
    before, sockets = our_segments(), _sockets()
    held = []
    share = memory.share_engine_memory

    def watched(owner, **pools):  # the hook's own call, watched: which segments it made
        shared = share(owner, **pools)
        held.append(our_segments() - before)
        return shared

    monkeypatch.setattr(memory, "share_engine_memory", watched)
    with pytest.raises(ClientError, match="nobody.sock"):
        queue_rank("prefill", Topology(1), 0, model_dir, pool=mha_pool(), metadata=metadata_buffers())
    assert held and held[0], "the pools had moved into /dev/shm before the registration failed"
    assert our_segments() == before and _sockets() == sockets


def test_a_start_refused_for_the_models_facts_leaves_no_segment(monkeypatch):
    # Mamba2 with n_groups=2 at attention TP 4: no rank layout SGLang's MambaMixer2 builds
    monkeypatch.setattr(plugin, "_parallel", lambda: SimpleNamespace(attn_tp_size=4, pp_size=1))
    shape = Mamba2StateShape.create(
        tp_world_size=4,
        intermediate_size=16,
        n_groups=2,
        num_heads=8,
        head_dim=2,
        state_size=4,
        conv_kernel=4,
    )
    params = Mamba2CacheParams(shape=shape, layers=[1])
    mamba = MambaPool(size=4, spec_state_size=0, cache_params=params, mamba_layer_ids=[1], device="cpu")
    pool = HybridLinearKVPool(
        size=32,
        dtype=torch.bfloat16,
        page_size=PAGE,
        head_num=1,
        head_dim=8,
        full_attention_layer_ids=[0],
        device="cpu",
        mamba_pool=mamba,
    )
    hf_config = SimpleNamespace(n_groups=2, mamba2_cache_params=params)
    before = our_segments()
    with pytest.raises(GeometryError, match="n_groups=2 over attn_tp_size 4"):
        plugin._init_kv_manager(lambda *a, **k: None, queue(PrefillBootstrapQueue, pool, Disagg(), hf_config))
    assert our_segments() == before


def test_an_mla_host_pool_is_refused_by_name_before_any_segment():
    pool = MLATokenToKVPool(
        size=32,
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    info = pool.get_device_pool_infos()[0].buffer_info
    host = MLATokenToKVPoolHost(
        info,
        2,
        0,
        PAGE,
        "layer_first",
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=pool.size,
        start_layer=0,
        end_layer=2,
        target_layer_num=2,
    )
    before = our_segments()
    with pytest.raises(GeometryError, match="MLATokenToKVPoolHost") as refused:
        share_engine_memory("mla-host", kv_pool=pool, metadata_buffers=metadata_buffers(), host_kv_pool=host)
    assert refused.value.code is Reason.LAYOUT_UNSUPPORTED
    assert our_segments() == before


def test_sparse_attention_state_is_refused_by_name_at_registration():
    # DeepSeek-V3.2's indexer cache comes as a "dsa" state component (SGLang's StateType.DSA)
    pool = mha_pool()
    memory = share_engine_memory("dsa", kv_pool=pool, metadata_buffers=metadata_buffers())
    try:
        rank = SglangRank("prefill", 0, pool, metadata_buffers(), None)
        kv_args: KVArgs = fill_kv_args(rank, page_size=PAGE, num_layers=2, total_kv_heads=2)
        kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = [], [], []
        kv_args.state_types = [StateType.DSA]
        kv_args.state_data_ptrs, kv_args.state_data_lens, kv_args.state_item_lens = [[]], [[]], [[]]
        with pytest.raises(PdTransferError) as refused:
            describe_rank(kv_args, memory, EngineFacts(attn_tp_size=1, total_kv_heads=2), Role.PREFILL)
        assert refused.value.code is Reason.LAYOUT_UNSUPPORTED
        assert "'dsa'" in str(refused.value) and "DeepSeek-V3.2" in str(refused.value)
    finally:
        memory.close()


def _sockets() -> set[str]:
    """This process's open socket descriptors (``socket:[inode]``)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if target.startswith("socket:"):
            out.add(target)
    return out


def test_a_registration_the_sidecar_refuses_leaves_no_socket_thread_or_segment(tmp_path, monkeypatch):
    # a real decode sidecar; SGLang's real PrefillBootstrapQueue registers a prefill rank with it,
    # which the sidecar refuses (role_mismatch) after the pools moved and the client connected
    from sglang.srt.plugins import load_plugins
    from sglang_deployment import Deployment
    from sglang_process import Topology, llama_dir, queue_rank

    load_plugins()
    model_dir = llama_dir(tmp_path, "tiny", layers=2, kv_heads=2, head_dim=8)
    deployment = Deployment(tmp_path, 0, 1)
    try:
        monkeypatch.setenv("PD_TRANSFER_SGLANG_WORKER_ENDPOINT", deployment.endpoint("decode", 0))
        sockets, threads, segments = _sockets(), set(threading.enumerate()), our_segments()
        with pytest.raises(PdTransferError) as refused:
            queue_rank("prefill", Topology(1), 0, model_dir, pool=mha_pool(), metadata=metadata_buffers())
        assert refused.value.code is Reason.ROLE_MISMATCH, refused.value
        # the traceback held by ``refused`` keeps the manager alive: what it opened must be closed
        assert _sockets() == sockets, "the refused start left its sidecar connection open"
        assert set(threading.enumerate()) == threads
        assert our_segments() == segments
    finally:
        deployment.close()
