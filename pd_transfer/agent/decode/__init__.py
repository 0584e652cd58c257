"""The decode side of a sidecar: it resolves prefill instances and takes their rooms.

``side`` (:class:`~pd_transfer.agent.decode.side.DecodeSide`, the ``Side``
the sidecar calls) registers the worker's rooms and checks what landed;
``prefill_instances`` resolves each prefill instance (rank table, sessions, verdicts);
``retire`` closes the sessions of a lost instance once quiet; ``bells`` rings
the room doorbells a worker's ``wait`` sleeps on.

May import the shared modules of ``pd_transfer.agent`` and every layer below;
never ``pd_transfer.agent.prefill`` (``tests/agent/test_agent_layering.py``).
This file imports nothing, so that importing one module of the folder does not
pull in the others.
"""
