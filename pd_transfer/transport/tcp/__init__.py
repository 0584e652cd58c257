"""The tcp data plane: chunks over plain TCP connections, no copies of ours.

``transport`` and ``link`` are the sending side, ``receiver`` and
``connection`` the receiving side; ``frames`` is their wire format,
``sockets``, ``iovecs`` and ``native_io`` the framed scatter/gather I/O, and
``handshake_gate`` the gate a threaded receiver keeps in front of strangers
(the engines' staging channel uses it as well).
"""
