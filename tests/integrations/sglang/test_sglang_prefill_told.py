"""A refused pair fails SGLang's prefill request with decode's text, not at a timeout.

SGLang's prefill scheduler creates the room's sender when the request arrives
and polls it in its bootstrap queue; decode's receiver announces the room. The
decode rank is refused (a KV dtype that differs), so decode's request fails
with every mismatch, and the prefill sender, polled through SGLang's
interface, fails with the same text (``peer_rejected``). The sidecars' and
the backend's bootstrap timeouts are far above the wait, so a timeout cannot
stand in for the refusal. Prefill TP 2, decode TP 1: both prefill ranks learn.
"""

from __future__ import annotations

import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.plugins import load_plugins
from sglang_deployment import Deployment, wait_for
from sglang_process import Topology, llama_dir, queue_rank
from sglang_ranks import metadata_buffers

from pd_transfer.integrations.sglang import conn


def _rank(role, tp_rank, tp, deployment, monkeypatch, dtype, model_dir):
    """SGLang's queue for ``role``, its manager built through the plugin's hook."""
    monkeypatch.setenv("PD_TRANSFER_SGLANG_WORKER_ENDPOINT", deployment.endpoint(role, tp_rank))
    pool = MHATokenToKVPool(
        size=32,
        page_size=4,
        dtype=dtype,
        head_num=4 // tp,
        head_dim=8,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    return queue_rank(role, Topology(tp), tp_rank, model_dir, pool=pool, metadata=metadata_buffers())


def test_the_prefill_request_of_a_refused_pair_fails_with_decodes_text(tmp_path, monkeypatch):
    deployment = Deployment(tmp_path, 2, 1, config={"bootstrap_timeout_s": 600.0})
    monkeypatch.setenv("PD_TRANSFER_SGLANG_BOOTSTRAP_TIMEOUT_S", "600")  # the backend's, not the sidecars'
    load_plugins()
    model_dir = llama_dir(tmp_path, "tiny", layers=2, kv_heads=4, head_dim=8)
    ranks = []
    try:
        ranks += [
            _rank("prefill", r, 2, deployment, monkeypatch, torch.bfloat16, model_dir) for r in range(2)
        ]
        ranks.append(_rank("decode", 0, 1, deployment, monkeypatch, torch.float16, model_dir))
        # SGLang's prefill creates its senders first (PrefillBootstrapQueue.create_sender)
        senders = [conn.PdTransferKVSender(r.manager, deployment.sglang_bootstrap, 31) for r in ranks[:2]]
        assert [s.poll() for s in senders] == [KVPoll.Bootstrapping] * 2
        receiver = conn.PdTransferKVReceiver(ranks[2].manager, deployment.sglang_bootstrap, 31)
        receiver.init(0)
        receiver.send_metadata([1, 2], 0, None)
        assert wait_for([receiver], KVPoll.Failed, 60) == [KVPoll.Failed]
        assert receiver.failure.startswith("[peer_rejected] room 31: ")
        assert "kv.layer[0-1].k.dtype: prefill=bfloat16 decode=float16" in receiver.failure
        assert wait_for(senders, KVPoll.Failed, 60) == [KVPoll.Failed] * 2
        assert [s.failure for s in senders] == [receiver.failure] * 2
    finally:
        for rank in ranks:
            rank.close()
        deployment.close()
