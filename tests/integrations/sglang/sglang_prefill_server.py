"""An SGLang prefill instance for the cross-engine test, run in SGLang's environment.

No environment imports both SGLang and vLLM, so the cross-engine test
(``tests/integrations/vllm/test_vllm_cross_engine.py``, in vLLM's
environment) starts this script with SGLang's python and hands it jobs: one
JSON file per job, its path on a line of stdin; the answer is a JSON file
next to it and the line ``DONE <path>`` on stdout.

Per job, every prefill rank is built as SGLang's scheduler builds it
(:mod:`sglang_process`): SGLang's own pools on CPU (``MHATokenToKVPool``, or
``HybridLinearKVPool`` + ``MambaPool`` for a GDN hybrid, its state sized by
SGLang's ``Qwen3NextConfig``), its real ``PrefillBootstrapQueue`` whose
constructor runs ``_init_kv_manager`` through the plugin's hook (registering
with the rank's sidecar), then the request's bytes written into the pools by
plain indexing and sent through ``PdTransferKVSender`` as SGLang's scheduler
calls it. The metadata row is the one stand-in (:class:`NoMetadataRows`). The answer is each sender's final state and failure text.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool, MHATokenToKVPool  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang_process import Topology, queue_rank, sglang_rank  # noqa: E402

from pd_transfer.integrations.sglang.conn import PdTransferKVSender  # noqa: E402

GDN_LAYERS, ATTN_LAYERS = [0, 2], [1, 3]
POLL_NAMES = {value: name for name, value in vars(KVPoll).items() if isinstance(value, int)}


def qwen3_next_dir(root: Path, job: dict) -> str:
    """A Qwen3-Next ``config.json`` with the job's GDN dimensions (no weights)."""
    path = root / "tiny-qwen3-next"
    path.mkdir(exist_ok=True)
    gdn = job["gdn"]
    config = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_attention_heads": job["kv_heads"],
        "num_key_value_heads": job["kv_heads"],
        "head_dim": job["head_dim"],
        "num_hidden_layers": 4,
        "full_attention_interval": 2,  # GDN on layers 0, 2; attention on 1, 3
        "linear_num_key_heads": gdn["k_heads"],
        "linear_key_head_dim": gdn["k_dim"],
        "linear_num_value_heads": gdn["v_heads"],
        "linear_value_head_dim": gdn["v_dim"],
        "linear_conv_kernel_dim": gdn["kernel"],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "vocab_size": 128,
        "max_position_embeddings": 256,
        "torch_dtype": "float16",
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


class NoMetadataRows:
    """A vLLM decode keeps no metadata row (vLLM recomputes the last prompt token), and the
    sidecars refuse a pair where one side registers rows the other lacks: the SGLang side
    registers none (SGLang's ``MetadataBuffers`` always holds some)."""

    def get_buf_infos(self):
        return [], [], []


def build_rank(job: dict, tp_rank: int, model_dir: str):
    tp, dtype = job["tp"], torch.float16
    os.environ["PD_TRANSFER_SGLANG_WORKER_ENDPOINT"] = job["endpoints"][tp_rank]
    common = dict(
        page_size=job["page"], dtype=dtype, head_num=job["kv_heads"] // tp, head_dim=job["head_dim"]
    )
    size = job["blocks"] * job["page"]
    if "gdn" in job:
        with sglang_rank("prefill", Topology(tp), tp_rank, model_path=model_dir):
            params = ModelConfig(model_dir).hf_config.mamba2_cache_params
        mamba = MambaPool(
            size=job["blocks"],
            spec_state_size=0,
            cache_params=params,
            mamba_layer_ids=params.layers,
            device="cpu",
        )
        pool = HybridLinearKVPool(
            size=size, full_attention_layer_ids=ATTN_LAYERS, device="cpu", mamba_pool=mamba, **common
        )
    else:
        pool = MHATokenToKVPool(
            size=size, layer_num=job["layers"], device="cpu", enable_memory_saver=False, **common
        )
    return queue_rank("prefill", Topology(tp), tp_rank, model_dir, pool=pool, metadata=NoMetadataRows())


def channels(groups: list[int], tp: int, tp_rank: int) -> np.ndarray:
    """Global conv channel ids a rank holds: each group split on its own."""
    out, start = [], 0
    for group in groups:
        per = group // tp
        out.append(np.arange(start + tp_rank * per, start + (tp_rank + 1) * per))
        start += group
    return np.concatenate(out)


def fill(rank, job: dict, arrays: dict) -> None:
    """The request's bytes into the rank's pools, by plain indexing of SGLang's buffers."""
    tp, page = job["tp"], job["page"]
    per = job["kv_heads"] // tp
    heads = slice(rank.tp_rank * per, (rank.tp_rank + 1) * per)
    kv = torch.from_numpy(arrays["kv"]).view(torch.float16)  # [layer, k|v, block, token, head, dim]
    full = getattr(rank.pool, "full_kv_pool", rank.pool)
    for i in range(kv.shape[0]):
        for which, buffers in enumerate((full.k_buffer, full.v_buffer)):
            for block in job["src"]:
                buffers[i][block * page : (block + 1) * page] = kv[i, which, block][:, heads]
    if "gdn" in job:
        cache, slot, gdn = rank.pool.mamba_pool.mamba_cache, job["src_slot"], job["gdn"]
        conv = torch.from_numpy(arrays["conv"]).view(torch.float16)  # [layer, tap, channel]
        temporal = torch.from_numpy(arrays["temporal"])  # [layer, v head, v dim, k dim]
        mine = torch.from_numpy(channels(gdn["groups"], tp, rank.tp_rank))
        v_per = gdn["v_heads"] // tp
        for i in range(len(GDN_LAYERS)):
            cache.conv[0][i, slot] = conv[i][:, mine].T
            cache.temporal[i, slot] = temporal[i][rank.tp_rank * v_per : (rank.tp_rank + 1) * v_per]


def run(job_path: Path) -> dict:
    job = json.loads(job_path.read_text())
    arrays = {name: np.load(job_path.parent / f"{name}.npy") for name in job["arrays"]}
    model_dir = qwen3_next_dir(job_path.parent, job) if "gdn" in job else job["model_dir"]
    ranks = []
    try:
        ranks = [build_rank(job, r, model_dir) for r in range(job["tp"])]
        for rank in ranks:
            fill(rank, job, arrays)
        senders = [PdTransferKVSender(r.manager, job["sglang_bootstrap"], job["room"]) for r in ranks]
        deadline = time.monotonic() + job["timeout_s"]
        while any(s.poll() == KVPoll.Bootstrapping for s in senders) and time.monotonic() < deadline:
            time.sleep(0.01)  # decode's request has not reached this sender yet
        state = [np.array([job["src_slot"]])] if "gdn" in job else None
        for sender in senders:
            sender.init(len(job["src"]), None)
            sender.send(np.array(job["src"], dtype=np.int64), state)
        while time.monotonic() < deadline:
            if all(s.poll() in (KVPoll.Success, KVPoll.Failed) for s in senders):
                break
            time.sleep(0.01)
        return {
            "states": [POLL_NAMES[s.poll()] for s in senders],
            "failures": [s.failure for s in senders],
            "views": sorted(v.path for v in ranks[0].manager.geometry.views),
        }
    finally:
        for rank in ranks:
            rank.close()


def main() -> None:
    load_plugins()
    for line in sys.stdin:
        job_path = Path(line.strip())
        try:
            answer = run(job_path)
        except Exception as err:  # noqa: BLE001 - the test reports it
            answer = {"error": f"{type(err).__name__}: {err}"}
        job_path.with_suffix(".answer.json").write_text(json.dumps(answer))
        print(f"DONE {job_path}", flush=True)


if __name__ == "__main__":
    main()
