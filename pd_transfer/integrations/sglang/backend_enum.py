"""The one unavoidable hack: a ``pd_transfer`` member in SGLang's closed ``TransferBackend``.

SGLang picks its transfer classes by ``TransferBackend(server_args.
disaggregation_transfer_backend)``, an Enum with no registry, so a plugin
backend has to become a member. :func:`add_backend_member` adds one, after
checking that the Enum is the one this module was written against: on an
SGLang whose ``TransferBackend`` differs it raises, naming both member sets,
rather than patching something it does not know.
"""

from __future__ import annotations

from typing import Any

MEMBER_NAME = "PD_TRANSFER"
MEMBER_VALUE = "pd_transfer"
# SGLang 0.5.23's members; a release that adds or renames one needs a look at this module
KNOWN_MEMBERS = frozenset({"MOONCAKE", "MORI", "NIXL", "ASCEND", "FAKE"})


class UnknownSglangVersion(RuntimeError):
    """SGLang's TransferBackend is not the one pd-transfer's plugin knows."""


def add_backend_member(transfer_backend: Any) -> Any:
    """``transfer_backend.PD_TRANSFER`` (added if missing); idempotent."""
    existing = transfer_backend._value2member_map_.get(MEMBER_VALUE)
    if existing is not None:
        return existing
    members = frozenset(transfer_backend.__members__)
    if members != KNOWN_MEMBERS:
        raise UnknownSglangVersion(
            f"pd-transfer's SGLang plugin knows TransferBackend members {sorted(KNOWN_MEMBERS)}, this SGLang "
            f"has {sorted(members)}; install the SGLang version pd-transfer supports (0.5.23) or a "
            f"pd-transfer release that knows this one"
        )
    # Enum members cannot be added through the class; build one as EnumType does
    member = object.__new__(transfer_backend)
    member._name_ = MEMBER_NAME
    member._value_ = MEMBER_VALUE
    member._sort_order_ = len(transfer_backend._member_names_)
    transfer_backend._member_map_[MEMBER_NAME] = member
    transfer_backend._value2member_map_[MEMBER_VALUE] = member
    transfer_backend._member_names_.append(MEMBER_NAME)
    type.__setattr__(transfer_backend, MEMBER_NAME, member)
    return member
