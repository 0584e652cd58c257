"""Child process for test_tcp: serve shm segments (made by the parent) with TcpReceivers.

Usage: python tcp_receiver_child.py '{"rank": {"region_id": "segment name", ...}, ...}'
Starts one receiver per rank, prints {"rank": address} as one JSON line, serves
until stdin closes, then prints {"chunks": n, "refused": n}.
"""

import asyncio
import json
import sys

from pd_transfer.memory.segments import open_segment
from pd_transfer.transport import TcpReceiver


async def main(ranks: dict) -> None:
    receivers = {}
    for rank, names in ranks.items():
        regions = {region_id: open_segment(name).tensor for region_id, name in names.items()}
        receivers[rank] = TcpReceiver("127.0.0.1", regions)
        await receivers[rank].start()
    print(json.dumps({rank: r.address for rank, r in receivers.items()}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # parent closes stdin
    for receiver in receivers.values():
        await receiver.stop()
    print(
        json.dumps(
            {
                "chunks": sum(r.stats.chunks_landed for r in receivers.values()),
                "refused": sum(r.stats.frames_refused for r in receivers.values()),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
