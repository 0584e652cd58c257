"""The sidecar agent: the only layer with asyncio and ZeroMQ.

Peers, rooms, timers, heartbeats, the worker-facing endpoint. Pure decisions
(reconciliation, planning, message validity) live below, in ``layout`` and
``protocol``; byte movement lives in ``transport``.

The modules here are shared by both roles (the sidecar, its runner, channels,
rooms, the ``Side`` protocol, task owners, the data plane). Each role's side
lives in its own folder, ``prefill/`` and ``decode/``; neither imports the
other (``tests/agent/test_agent_layering.py``). Outside this package only the
entry points that start a sidecar (``cli``, ``server``, ``demo``) import it.
"""
