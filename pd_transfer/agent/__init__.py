"""The sidecar agent: the only layer with asyncio and ZeroMQ.

Peers, rooms, timers, heartbeats, the worker-facing endpoint. Pure decisions
(reconciliation, planning, message validity) live below, in ``layout`` and
``protocol``; byte movement lives in ``transport``.
"""
