"""Child process for test_shm_transport: rebuild a scenario, write it into the parent's segments.

Usage: python shm_writer_child.py '<json>' where json is
{"scenario": {kwargs of build_scenario}, "segments": {dst_rank: {region_id: segment name}}}.
The World is deterministic in its seed, so the child's source bytes are the parent's.
"""

import asyncio
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import build_scenario  # noqa: E402

from pd_transfer.transport import PeerEndpoint, ShmTransport  # noqa: E402


async def main(args: dict) -> None:
    sc = build_scenario(**args["scenario"])
    transport = ShmTransport()
    for plan in sc.plans:
        names = args["segments"][plan.dst_rank]
        sizes = {region_id: buf.size for region_id, buf in sc.dst(plan).items()}
        link = await transport.connect(PeerEndpoint.from_maps(plan.dst_rank, sizes, names))
        written = await transport.write(link, plan, sc.src(plan), room=1)
        assert written == plan.total_nbytes
    await transport.close()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
