"""pd-transfer as a vLLM KV connector (``pip install 'pd-transfer[vllm]'``).

Turned on by module path, on each instance::

    --kv-transfer-config '{"kv_connector": "PdTransferConnector",
                           "kv_connector_module_path": "pd_transfer.integrations.vllm",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {
                               "worker_endpoint": "unix:///run/pd/prefill-tp{tp_rank}.sock",
                               "bootstrap_addr": "tcp://10.0.0.1:7000"}}'

:class:`PdTransferConnector` (in :mod:`.connector`) is imported on first use,
so the pure modules here (:mod:`.memory`, :mod:`.params`,
:mod:`.scheduler_side`, ...) import without vLLM. See docs/vllm.md.
"""

from __future__ import annotations

__all__ = ["PdTransferConnector", "PdTransferConnectorMetadata"]


def __getattr__(name: str):
    if name in __all__:
        from pd_transfer.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
