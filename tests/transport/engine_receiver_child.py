"""Child process for the engine transport tests: serve shm segments with engine receivers.

Usage: python engine_receiver_child.py '{"kind": "mooncake", "ranks": {"rank": {"region_id":
"segment name", ...}, ...}}'. Starts one receiver per rank (each maps the
parent's segments), prints {"rank": data_address} as one JSON line, then
serves until stdin closes. A line "unregister RANK REGION" on stdin takes one
region away from that rank's engine (to make the engine fail a write) and
answers "ok"; "unregister RANK staging" and "register RANK staging" do the
same to, and undo it for, the rank's staging area.

``"agent"`` (nixl only) picks the receivers' agent: ``"own"`` (default, each
receiver starts its own), ``"shared"`` (the receiving agent of this process's
transport, as a decode sidecar has it), ``"unprogressed"`` (one agent without
a progress thread: nothing progresses it while the child waits on stdin).
"""

import asyncio
import json
import sys

from pd_transfer.memory.segments import open_segment
from pd_transfer.transport.engines.registry import make_receiver, make_transport


def receiver_options(args: dict) -> dict:
    agent = args.get("agent", "own")
    if agent == "shared":
        return {"transport": make_transport(args["kind"])}
    if agent == "unprogressed":
        from pd_transfer.transport.engines.nixl import NixlEngine, NixlReceiver

        engine = NixlEngine("recv", progress_thread=False)
        return {"make": lambda regions: NixlReceiver(regions, engine=engine)}
    return {}


async def main(args: dict) -> None:
    receivers, segments = {}, []
    options = receiver_options(args)
    make = options.pop("make", lambda regions: make_receiver(args["kind"], regions, **options))
    for rank, names in args["ranks"].items():
        regions = {}
        for region_id, name in names.items():
            segment = open_segment(name)
            segments.append(segment)
            regions[region_id] = segment.tensor
        receivers[rank] = make(regions)
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
