"""Every size cap of every framing: frames, texts, lists, maps, nesting.

A peer is untrusted. Before a frame is turned into objects its size is
checked; while msgpack unpacks it, string, binary, list and map lengths are
capped by msgpack's own ``max_*_len`` options (a :class:`Limits`); after
unpacking, the nesting depth is measured (:func:`check_depth`). Then each
field's kind (:mod:`pd_transfer.wire.fields`) enforces its own cap, named
here. One table, so a cap is changed in one place and its reason is next to
it; no framing keeps a number of its own.

Pure; imports only the standard library and ``pd_transfer.errors``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pd_transfer.errors import ProtocolError, Reason


@dataclass(frozen=True)
class Limits:
    """Caps enforced while unpacking one frame (see the table below for each framing's)."""

    max_frame_nbytes: int = 16 * 1024 * 1024
    max_list_len: int = 65536
    max_map_len: int = 256
    max_str_len: int = 8192
    max_depth: int = 16

    def unpack_options(self) -> dict[str, Any]:
        """Keyword arguments for ``msgpack.unpackb``."""
        return {
            "raw": False,  # str -> str; invalid UTF-8 is an error
            "strict_map_key": True,  # map keys must be str or bytes
            "use_list": True,
            "max_str_len": self.max_str_len,
            "max_bin_len": self.max_frame_nbytes,
            "max_array_len": self.max_list_len,
            "max_map_len": self.max_map_len,
            "max_ext_len": 0,  # no msgpack extension types on our wire
        }


# --- texts and names (characters) -------------------------------------------

#: an id or name: agent, instance, rank, room on the data plane, region id.
#: Operators choose these; 256 fits any hostname:port plus a suffix.
MAX_ID_LEN = 256
#: a message type tag ("t") or a reason code: the longest we define has 22
#: characters; a newer minor version may add longer ones.
MAX_TAG_LEN = 64
MAX_REASON_CODE_LEN = 64
#: a human-readable reason in a protocol message (Close, a failed Done): long
#: enough for a nested error with its hint, short enough to log whole.
MAX_TEXT_LEN = 4096
#: the reason text of a handshake result: it must fit the 2 KiB handshake frame.
MAX_HANDSHAKE_TEXT_LEN = 1024
#: a data-plane Fail's text as sent: under half a page of log; receivers accept
#: up to MAX_FAIL_TEXT_LEN so a peer that clips a little later is not refused.
FAIL_TEXT_SENT_LEN = 2000
MAX_FAIL_TEXT_LEN = 4000
#: a dtype or strategy name ("float8_e4m3fn" is the longest dtype).
MAX_SHORT_NAME_LEN = 32
#: an endpoint or config path: tcp://[ipv6]:port, an ipc:// socket path.
MAX_ADDRESS_LEN = 512
#: a registered region's handle (shm name, CUDA IPC or engine handle string).
MAX_HANDLE_LEN = 1024
#: a CUDA IPC handle string: base64 of eight small fields, a few hundred characters.
MAX_CUDA_IPC_HANDLE_LEN = 4096
#: a staging control channel's address in an engine address (tcp://host:port).
MAX_STAGING_CONTROL_LEN = 300
#: an engine transport's data address (Register.data_address): base64 of
#: zlib'd regions; 8192 holds a few hundred regions.
MAX_ENGINE_ADDRESS_LEN = 8192

# --- lists (items) -----------------------------------------------------------

#: any list field without a cap of its own (ranks, pools, views of one rank).
MAX_LIST_LEN = 1024
#: one rank's registration: views (DeepSeek-V3 registers 64; a 512-layer
#: model with 16 tensors a layer fits), regions, axes of one view (a paged KV
#: tensor has 4 to 6), and shard groups of one axis (one per TP rank group).
MAX_VIEWS = 8192
MAX_REGIONS = 8192
MAX_NDIM = 8
MAX_SHARD_GROUPS = 64
#: capability names (transports, features) one side announces.
MAX_CAPABILITIES = 64
#: pools of one rank: a request or a Done names each at most once (kv, swa,
#: mamba, aux, and room to grow); a verdict's plan lists them with their modes.
MAX_REQUEST_POOLS = 8
MAX_PLAN_POOLS = 64
#: region handles one registration carries (one per registered region).
MAX_REGION_HANDLES = 65536
#: ranks in one bootstrap rank table (TP x PP x DP of one instance group).
MAX_RANK_ENTRIES = 1 << 16
#: mismatches in one verdict, and source ranks one decode rank reads from.
MAX_MISMATCHES = 4096
MAX_SRC_RANKS = 4096
#: page, slot or row indices in one request: 4M is a 4M-token context at one
#: token a page. Packed as int64 that is 32 MiB, so the frame cap binds first.
MAX_INDICES = 1 << 22
#: integrity checksums in one Done, per pool: one per destination index (as
#: many as a request may name) and one per tensor piece.
MAX_CHECKSUM_ITEMS = MAX_INDICES
MAX_CHECKSUM_TENSORS = 1 << 16
#: destination regions one tcp chunk names: at most one per region of a rank,
#: and a rank registers one region a tensor (K and V of each layer, per pool).
MAX_REGIONS_PER_CHUNK = 4096
#: staging slots in one ring: enough to keep a link busy, few enough that one
#: peer cannot take a decode's whole staging area.
MAX_RING_SLOTS = 64
#: regions in one engine address (every tensor of a rank, split per layer).
MAX_ENGINE_ADDRESS_REGIONS = 65536

# --- frames (bytes) and their unpacking caps ---------------------------------

#: a protocol frame between sidecars. The largest message we expect: a
#: DeepSeek-V3 registration is about 30 KB, a transfer request for 64k pages is
#: 512 KB packed. Index lists travel as packed int64 bytes, so max_list_len can
#: stay small while a request still addresses millions of pages.
PROTOCOL_LIMITS = Limits()
#: the four handshake messages are tiny (two 32-byte blobs and an id): 2 KiB,
#: flat maps (depth 2 for the version list), before any secret is checked.
HANDSHAKE_LIMITS = Limits(
    max_frame_nbytes=2048, max_list_len=16, max_map_len=16, max_str_len=MAX_HANDSHAKE_TEXT_LEN, max_depth=2
)
#: a tcp data-plane header or staging control frame: a chunk's runs table is
#: 24 bytes a run, so 8 MiB holds 350k runs, as many as a 4 MiB chunk has when
#: its runs are 12 bytes long.
DATA_PLANE_HEADER_NBYTES = 8 << 20
#: data-plane headers are flat maps of under 16 keys with one list (regions,
#: slots) at depth 2; strings are ids or a Fail's text.
DATA_PLANE_LIMITS = Limits(
    max_frame_nbytes=DATA_PLANE_HEADER_NBYTES,
    max_list_len=1 << 16,
    max_map_len=16,
    max_str_len=MAX_TEXT_LEN,
    max_depth=4,
)
#: one worker API request: a register carries every tensor's geometry and a
#: send up to MAX_INDICES indices as a msgpack list (9 bytes an index).
MAX_WORKER_REQUEST_NBYTES = 64 * 1024 * 1024
#: a worker request's map entries: a register's handles map has one per region.
MAX_WORKER_MAP_LEN = 1 << 16
#: a worker request: index lists travel as plain msgpack lists (up to
#: MAX_INDICES items); strings are ids and handles (a CUDA IPC handle is the
#: longest, MAX_CUDA_IPC_HANDLE_LEN, so 64 KiB is 16 times it); a register nests its geometry as deep as
#: a protocol Register does.
WORKER_LIMITS = Limits(
    max_frame_nbytes=MAX_WORKER_REQUEST_NBYTES,
    max_list_len=MAX_INDICES,
    max_map_len=MAX_WORKER_MAP_LEN,
    max_str_len=1 << 16,
    max_depth=PROTOCOL_LIMITS.max_depth,
)
#: an engine address's payload once inflated: refuses zlib bombs.
MAX_ENGINE_ADDRESS_PAYLOAD_NBYTES = 1 << 20
ENGINE_ADDRESS_LIMITS = Limits(
    max_frame_nbytes=MAX_ENGINE_ADDRESS_PAYLOAD_NBYTES,
    max_list_len=MAX_ENGINE_ADDRESS_REGIONS,
    max_map_len=8,
    max_str_len=4096,
    max_depth=4,
)

#: a CUDA IPC handle: one flat list of eight ints, blobs and a bool.
CUDA_IPC_HANDLE_LIMITS = Limits(
    max_frame_nbytes=MAX_CUDA_IPC_HANDLE_LEN, max_list_len=8, max_map_len=0, max_str_len=0, max_depth=1
)

#: every framing's unpacking caps, by name (docs and tests read this).
FRAMINGS: dict[str, Limits] = {
    "protocol": PROTOCOL_LIMITS,
    "handshake": HANDSHAKE_LIMITS,
    "data_plane": DATA_PLANE_LIMITS,
    "engine_address": ENGINE_ADDRESS_LIMITS,
    "worker_request": WORKER_LIMITS,
    "cuda_ipc_handle": CUDA_IPC_HANDLE_LIMITS,
}

DEFAULT_LIMITS = PROTOCOL_LIMITS


def check_depth(value: Any, max_depth: int) -> None:
    """Raise ``limit_exceeded`` if ``value`` nests lists/maps deeper than ``max_depth``.

    The top-level map is depth 1: ``{"t": "hello", "x": [[1]]}`` has depth 3.
    Iterative, so a hostile frame cannot exhaust the Python stack.
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise ProtocolError(
                f"frame nests deeper than {max_depth} levels", code=Reason.LIMIT_EXCEEDED, path="$"
            )
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
