"""Staged engine writes: gather into a slot, one bulk write, decode scatters.

``sender`` is the prefill side, ``receiver`` the decode side's staging area
and control channel, ``channel_requests`` that channel's requests, and ``link_staging`` what
the Mooncake and NIXL transports do with both.
"""
