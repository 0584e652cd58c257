"""The prefill side of a sidecar: it answers decode peers and sends them rooms.

``side`` (:class:`~pd_transfer.agent.prefill.side.PrefillSide`, the ``Side``
the sidecar calls) serves the decode sessions and is composed of the rest:
``sends`` takes the worker's sends and layer announcements; ``writes`` pumps
each room to its targets, ``endings`` ends rooms and releases peers;
``rank_table`` serves rank 0's rank table; ``acceptance`` and ``verdicts``
answer a decode rank's Register with a Verdict; ``decode_instances`` gathers the
ranks of each decode instance and ``ownership`` binds rooms to one of them;
``chunks``, ``streaming``, ``layers`` and ``flow`` cut a send into chunks and
write them to their targets; ``records`` holds the rooms, targets and peers.

May import the shared modules of ``pd_transfer.agent`` and every layer below;
never ``pd_transfer.agent.decode`` (``tests/agent/test_agent_layering.py``).
This file imports nothing, so that importing one module of the folder does not
pull in the others.
"""
