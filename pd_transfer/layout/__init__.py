"""Pure layout core: tensor views, pool builders, reconciliation, planning.

This layer may import numpy and the standard library, and
``pd_transfer.errors``. It must not import asyncio, zmq, prometheus_client or
anything above it in the package (protocol, transport, agent, client).
"""
