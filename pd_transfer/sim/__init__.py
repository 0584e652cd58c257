"""A simulated GPU worker: pools in shared memory, driven like an engine would.

    content      deterministic bytes for every logical element of every tensor,
                 computed on demand (never a whole tensor in memory)
    schedule     the request schedule both sides derive independently from a seed
    bookkeeping  what both engines share: options, per-room outcomes, progress
    prefill      the prefill engine loop (blocking Client): fill, send in chunks, wait
    decode       the decode engine loop (AsyncClient): expect, wait, verify every byte
    report       the JSON report a worker writes for the demo
    worker       the process entry point: ``python -m pd_transfer.sim.worker``

Uses the client library and the layout layer; never the agent.
"""
