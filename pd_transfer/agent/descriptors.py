"""The process's open-file limit, and the descriptors kept from strangers under it.

A sidecar holds a descriptor per peer connection, per pending stranger and per
shared segment; the soft limit many hosts default to (1,024) is lifted to the
hard one at start, and the lobby (:mod:`.lobby`) keeps a reserve below it that
unauthenticated connections never get: authenticated peers, the worker and the
health port still find descriptors while strangers flood a port.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)


def raise_fd_limit() -> int:
    """Lift the soft ``RLIMIT_NOFILE`` to the hard limit; returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard or soft == resource.RLIM_INFINITY:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as err:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, err)
    return soft


def fd_reserve_for(limit: int) -> int:
    """Descriptors kept from strangers: an eighth of the limit, at least 64."""
    return max(64, limit // 8)
