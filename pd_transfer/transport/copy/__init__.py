"""Executing a checked plan between mapped regions: the copy engine and its parts.

``runs`` turns a plan into byte runs and checks them against the regions;
``tasks`` compiles them into work for the engine's threads; ``copy_engine`` runs
that work; ``grid`` and ``native_loop`` copy through the C loop in
``transport/native/``; ``device`` copies between torch tensors on any device;
``packing`` is the gather and scatter halves for transports that ship bytes;
``checksums`` sums blocks the same way at both ends.

Layering: numpy, torch and ``pd_transfer.layout``; no sockets, no asyncio,
nothing from a transport that moves bytes over a network.
"""
