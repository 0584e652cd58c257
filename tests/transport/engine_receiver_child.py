"""Child process for the engine transport tests: serve shm segments with engine receivers.

Usage: python engine_receiver_child.py '{"kind": "mooncake", "ranks": {"rank": {"region_id":
"segment name", ...}, ...}}'. Starts one receiver per rank (each maps the
parent's segments), prints {"rank": data_address} as one JSON line, then
serves until stdin closes. A line "unregister RANK REGION" on stdin takes one
region away from that rank's engine (to make the engine fail a write) and
answers "ok"; "unregister RANK staging" and "register RANK staging" do the
same to, and undo it for, the rank's staging area.
"""

import asyncio
import json
import sys

from pd_transfer.shm import open_segment
from pd_transfer.transport.engines import make_receiver


async def main(args: dict) -> None:
    receivers, segments = {}, []
    for rank, names in args["ranks"].items():
        regions = {}
        for region_id, name in names.items():
            segment = open_segment(name)
            segments.append(segment)
            regions[region_id] = segment.tensor
        receivers[rank] = make_receiver(args["kind"], regions)
        await receivers[rank].start()
    print(json.dumps({rank: r.address for rank, r in receivers.items()}), flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        words = line.split()
        if words and words[0] in ("unregister", "register"):
            receiver = receivers[words[1]]
            area = receiver.staging.area
            if words[2] == "staging" and words[0] == "register":
                receiver.engine.register({"staging": (area.address, area.buffer.nbytes)})
            elif words[2] == "staging":
                receiver.unregister(area.address)
            else:
                receiver.unregister(int(receiver.regions[words[2]].data_ptr()))
            print("ok", flush=True)
    for receiver in receivers.values():
        await receiver.stop()
    for segment in segments:
        segment.close()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
