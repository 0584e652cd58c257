"""One disaggregated run of a real vLLM engine on CPU through pd-transfer (run by the test).

    python pd_run.py WORKDIR MODE

Writes a tiny Llama (random float16 weights, no hub) to WORKDIR/model unless
it is there, then, with the two sidecars the test started (their endpoints
and the secret in WORKDIR/run.json):

- ``baseline``: greedy tokens of the prompts from one engine, no connector;
- ``pd``: prefill engine (kv_producer, max_tokens 1, do_remote_decode), then
  decode engine (kv_consumer) with the kv_transfer_params prefill returned;
- ``withheld``: as ``pd``, but decode is handed a room prefill never sent.

Prints one JSON line: {"tokens": [[...], ...], "errors": [...]}. vLLM spawns
its engine core: everything runs under ``if __name__ == "__main__"``.
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


def write_model(path: Path) -> None:
    if (path / "config.json").exists():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        torch_dtype="float16",
    )
    model = LlamaForCausalLM(config).to(torch.float16)
    model.save_pretrained(str(path))


def engine(model: Path, transfer: dict | None):
    from vllm import LLM

    kwargs = {}
    if transfer is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**transfer)
    return LLM(
        model=str(model),
        dtype="float16",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=128,
        block_size=32,
        seed=0,
        **kwargs,
    )


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


def main() -> None:
    workdir, mode = Path(sys.argv[1]), sys.argv[2]
    model = workdir / "model"
    write_model(model)
    result: dict = {"tokens": [], "errors": []}
    if mode == "baseline":
        outs = generate(engine(model, None), PROMPTS, [None] * len(PROMPTS), MAX_TOKENS)
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    else:
        run = json.loads((workdir / "run.json").read_text())
        # both engines up first, as in a deployment: a prefilled room waits for decode's
        # request only bootstrap_timeout_s, far less than an engine's start on this host
        decode = engine(model, transfer_config(run, "decode"))
        prefill = engine(model, transfer_config(run, "prefill"))
        outs = generate(prefill, PROMPTS, [{"do_remote_decode": True}] * len(PROMPTS), 1)
        params = [o.kv_transfer_params for o in outs]
        result["first"] = [list(o.outputs[0].token_ids) for o in outs]
        result["params"] = params
        if mode == "withheld":
            params = [{**p, "pd_transfer_room": int(p["pd_transfer_room"]) + 977} for p in params]
        try:
            outs = generate(decode, PROMPTS, params, MAX_TOKENS)
            result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
            result["finish"] = [str(o.outputs[0].finish_reason) for o in outs]
            result["kv_transfer_params"] = [o.kv_transfer_params for o in outs]
        except Exception as err:  # the failure policy may end the whole request
            result["errors"].append(f"{type(err).__name__}: {err}")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
