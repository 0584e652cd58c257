"""Many requests through BOTH vLLM schedulers and their workers' connectors, over real sidecars.

Each side is vLLM 0.33's real ``Scheduler`` with the connector, stepped with
its instance's worker connectors (as vLLM's model runner calls them). The
forward pass is the one thing the test plays: for every token a step
computes it writes the oracle's KV into that token's slot of the request's
blocks, on prefill and on decode alike. The oracle is independent of
pd-transfer and of block sizes: a token's K|V depends only on the prompt
tokens up to it (a rolling hash), so a prefix-cache hit on either side holds
the same bytes as a fresh computation. When decode first runs a request
whose KV was loaded, every loaded position of its blocks must hold the
oracle's bytes: checked there, bit for bit, on every rank.
Imported only by test modules that already skipped without vLLM.
"""

from __future__ import annotations

import torch
from vllm.v1.request import RequestStatus
from vllm_harness import attention_cache_config, runner_output, scheduler, vllm_config
from vllm_instances import HEAD_SIZE, LAYERS, TOTAL_HEADS, rank_heads, run_until

MOD = 2**31 - 1


def prefix_hashes(tokens: list[int]) -> torch.Tensor:
    """One hash per position of the tokens up to it: equal prefixes, equal hashes."""
    out, h = [], 0
    for token in tokens:
        h = (h * 1000003 + token + 1) % MOD
        out.append(h)
    return torch.tensor(out, dtype=torch.int64)


def oracle_rows(hashes: torch.Tensor, layer: int) -> torch.Tensor:
    """The K|V rows of these positions in one layer: [positions, all heads, 2 * head_size] float16."""
    j = torch.arange(TOTAL_HEADS * 2 * HEAD_SIZE, dtype=torch.int64)
    x = (hashes[:, None] * 2654435761 + j[None, :] * 40503 + layer * 7919) % 65521
    return (x.float() / 65521 - 0.5).half().view(-1, TOTAL_HEADS, 2 * HEAD_SIZE)


def cache_builder(block_size: int, num_blocks: int, dtype=torch.float16):
    """``Instance(build=...)``: every layer a view into one storage, CPU-backend shaped, of this block size."""

    def build(tp_size: int, rank: int):
        heads = TOTAL_HEADS // tp_size
        config = attention_cache_config(
            LAYERS, num_blocks=num_blocks, num_kv_heads=heads, head_size=HEAD_SIZE, block_size=block_size
        )
        shape = (num_blocks, heads, block_size, 2 * HEAD_SIZE)
        per_layer = torch.Size(shape).numel()
        storage = torch.randn(NUM_LAYERS * per_layer, generator=torch.Generator().manual_seed(rank)).to(dtype)
        caches = {n: storage[i * per_layer : (i + 1) * per_layer].view(shape) for i, n in enumerate(LAYERS)}
        return config, caches

    return build


NUM_LAYERS = len(LAYERS)


class Side:
    """One vLLM instance: its scheduler and its workers' connectors on real sidecars, stepped together."""

    def __init__(
        self,
        instances,
        model_dir,
        role,
        tp_size,
        bootstrap,
        block_size,
        num_blocks,
        *,
        dtype=torch.float16,
        sidecar=None,
        **cfg,
    ):
        """``sidecar``: sidecar settings over the defaults; ``cfg``: :func:`vllm_config`'s keywords."""
        extra = {"bootstrap_addr": bootstrap} if role == "kv_producer" else {}
        self.block_size = block_size
        self.sched = scheduler(
            vllm_config(model_dir, kv_role=role, extra=extra, block_size=block_size, **cfg),
            num_blocks=num_blocks,
        )
        self.instance = instances(
            role, tp_size, bootstrap, build=cache_builder(block_size, num_blocks, dtype), config=sidecar
        )
        self.free_at_start = self.sched.kv_cache_manager.block_pool.get_num_free_blocks()
        self.reported = {"sending": set(), "recving": set()}
        self._seen = [{"sending": set(), "recving": set()} for _ in self.instance.connectors]
        self.first_runs: dict[str, tuple[int, int]] = {}  # req id -> (computed before, scheduled)
        self.recvs: dict[str, object] = {}  # decode: req id -> its RecvSpec
        self.outputs = []

    def blocks(self, req_id: str) -> list[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(req_id)[0])

    def step(self, on_first_run=None):
        out = self.sched.schedule()
        self.recvs.update((r.req_id, r) for r in out.kv_connector_metadata.step.recvs)
        starts = _starts(out)
        for req_id, start in starts.items():
            if req_id not in self.first_runs:
                self.first_runs[req_id] = (start, out.num_scheduled_tokens[req_id])
                if on_first_run is not None:
                    on_first_run(self, req_id, start)
        self._forward(out, starts)
        errors = self._connectors(out)
        report = self._report()
        running = [self.sched.requests[r] for r in out.num_scheduled_tokens]
        partial = {r.request_id for r in running if r.is_prefill_chunk}
        engine_outputs = self.sched.update_from_output(
            out, runner_output(running, invalid_block_ids=errors, partial=partial, **report)
        )
        self.outputs += [o for outs in engine_outputs.values() for o in outs.outputs]
        return out

    def _forward(self, out, starts: dict[str, int]) -> None:
        """The model: the oracle's KV for every token this step computes, into its block slot."""
        for req_id, start in starts.items():
            req = self.sched.requests[req_id]
            count = out.num_scheduled_tokens[req_id]
            positions = torch.arange(start, start + count)
            hashes = prefix_hashes(list(req.all_token_ids)[: start + count])[start:]
            blocks = torch.tensor(self.blocks(req_id))[positions // self.block_size]
            slots = positions % self.block_size
            for rank, caches in enumerate(self.instance.caches):
                heads = rank_heads(self.instance.tp_size, rank)
                for layer, name in enumerate(LAYERS):
                    cache = caches[name]
                    cache[blocks, :, slots] = oracle_rows(hashes, layer)[:, heads].to(cache.dtype)

    def _connectors(self, out):
        errors = set()
        for rank, connector in enumerate(self.instance.connectors):
            connector.bind_connector_metadata(out.kv_connector_metadata)
            connector.start_load_kv(None)
            for name in LAYERS:
                connector.save_kv_layer(name, None, None)
            connector.wait_for_save()
            results = connector.get_transfer_results(out.finished_req_ids)
            errors |= connector.get_block_ids_with_load_errors()
            connector.clear_connector_metadata()
            self._seen[rank]["sending"] |= results.finished_sending
            self._seen[rank]["recving"] |= results.finished_recving
        return errors

    def _report(self) -> dict:
        """Finished once EVERY rank reported it, as vLLM's output aggregator does."""
        report = {}
        for kind in ("sending", "recving"):
            done = set.intersection(*(seen[kind] for seen in self._seen)) - self.reported[kind]
            self.reported[kind] |= done
            report[f"finished_{kind}"] = done
        return report

    def idle(self) -> bool:
        return not self.sched.requests

    def num_free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()


def _starts(out) -> dict[str, int]:
    """Each scheduled request's first position this step (its computed tokens before the step)."""
    starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens))
    return {r: s for r, s in starts.items() if r in out.num_scheduled_tokens}


def check_loaded_kv(side: Side, req_id: str, start: int) -> None:
    """Decode runs a request for the first time: its loaded positions hold the oracle's KV, bit for bit."""
    req = side.sched.requests[req_id]
    if start == 0:
        return  # computed locally from the first token: nothing was loaded
    positions = torch.arange(start)
    hashes = prefix_hashes(list(req.prompt_token_ids)[:start])
    blocks = torch.tensor(side.blocks(req_id))[positions // side.block_size]
    slots = positions % side.block_size
    for rank, caches in enumerate(side.instance.caches):
        heads = rank_heads(side.instance.tp_size, rank)
        for layer, name in enumerate(LAYERS):
            got = caches[name][blocks, :, slots].contiguous().view(torch.int16)
            want = oracle_rows(hashes, layer)[:, heads].contiguous().view(torch.int16)
            bad = (got != want).any(dim=-1).any(dim=-1).nonzero().flatten()
            assert bad.numel() == 0, (
                f"{req_id} ({len(req.prompt_token_ids)} tokens) rank {rank} {name}: "
                f"{bad.numel()} of {start} loaded positions differ, first {bad[:5].tolist()}"
            )


def run_pd(
    prefill: Side,
    decode: Side,
    prompts: list[list[int]],
    max_tokens: int = 2,
    timeout_s=600,
    until_prefill_idle: bool = True,
    on_first_run=check_loaded_kv,
):
    """Every prompt prefilled then decoded, as a router does; returns {prompt index: decode request}.

    Runs until decode finished every request (and prefill returned every
    block, unless ``until_prefill_idle`` is False). ``on_first_run(side, req_id,
    start)``: the check when decode first runs a request.
    """
    from vllm_harness import request

    first = {}
    for i, prompt in enumerate(prompts):
        req = request(
            len(prompt),
            kv_transfer_params={"do_remote_decode": True},
            max_tokens=1,
            block_size=prefill.block_size,
            prompt=prompt,
        )
        prefill.sched.add_request(req)
        first[req.request_id] = i
    second, forwarded = {}, set()

    def forward_finished() -> None:
        for output in prefill.outputs:
            i = first.get(output.request_id)
            if i is None or output.request_id in forwarded or not output.finished:
                continue
            forwarded.add(output.request_id)
            req = request(
                len(prompts[i]),
                kv_transfer_params=output.kv_transfer_params,
                max_tokens=max_tokens,
                block_size=decode.block_size,
                prompt=prompts[i],
            )
            decode.sched.add_request(req)
            second[i] = req

    def step() -> bool:
        prefill.step()
        forward_finished()
        decode.step(on_first_run=on_first_run)
        return len(second) == len(prompts) and decode.idle() and (prefill.idle() or not until_prefill_idle)

    run_until(step, timeout_s, "every request prefilled and decoded", lambda: _logs(prefill, decode))
    return second


def _logs(*sides: Side) -> str:
    return "\n".join(s.instance.logs() for s in sides)


def assert_loaded_then_ran_one_token(decode: Side, reqs: dict) -> None:
    """Each decode request loaded all but its last prompt token, then computed that one."""
    for req in reqs.values():
        n = len(req.prompt_token_ids)
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED, (n, req.status)
        start, count = decode.first_runs[req.request_id]
        if n > 1:
            assert (start, count) == (n - 1, 1), f"{n}-token prompt first ran from {start}, {count} tokens"
