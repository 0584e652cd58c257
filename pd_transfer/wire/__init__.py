"""The wire layer: one typed field layer and one envelope for every framing.

Below the protocol and the transports. Each framing of the project (the
protocol between sidecars, the security handshake, the tcp data plane's
headers, the staging control channel, the worker API and engine addresses)
unpacks with :mod:`envelope` under caps from :mod:`limits` and reads its fields
with the kinds of :mod:`fields`, so each error names its field path
msgspec-style (``at $.chunk.regions[2]: expected str, got int``).

    fields.py    field kinds: typed encode/decode with $.paths in errors; Record
    packed.py    byte-valued kinds: packed indices and checksums, blobs, row tables
    envelope.py  pack/unpack under limits; Envelope: the tagged, versioned header
    limits.py    every size cap of every framing, named, each with its reason

May import: the standard library, msgpack and ``pd_transfer.errors``. Nothing
else of pd_transfer; no I/O.
"""
