"""``pd-transfer serve``: config -> sidecar -> event loop (uvicorn's CLI -> Config -> Server).

Exit codes: 0 after a clean stop, 2 for an invalid configuration, 3 when the
sidecar cannot start (an address already in use, an unwritable ipc path).
"""

from __future__ import annotations

import logging

import zmq

from pd_transfer.agent.auth import Security
from pd_transfer.agent.roles import sidecar_for
from pd_transfer.agent.runner import run_until_stopped
from pd_transfer.config.sidecar import SidecarConfig
from pd_transfer.observability.logs import configure_logging  # noqa: F401  (re-exported for the CLI)

EXIT_STARTUP_FAILED = 3

log = logging.getLogger(__name__)


def serve(config: SidecarConfig, security: Security | None = None) -> int:
    sidecar = sidecar_for(config, security=security)
    try:
        run_until_stopped(sidecar)
    except (zmq.ZMQError, OSError) as err:
        log.error("cannot start the %s sidecar: %s", config.role.value, err)
        return EXIT_STARTUP_FAILED
    return 0
