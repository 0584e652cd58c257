"""The small router of docs/vllm.md as a process: prefill, then decode, for ``/v1/completions``.

    python pd_proxy.py --port P --prefill URL --decode URL [--decode-sidecar URL]

1. the request goes to prefill with ``max_tokens: 1`` and
   ``kv_transfer_params: {"do_remote_decode": true}``;
2. the original request goes to decode with the ``kv_transfer_params``
   prefill answered (streamed back when the client asked for a stream);
3. when decode fails the request, vLLM's error says only "Internal server
   error" (a connector cannot put its reason in it): the router reads the
   room's reason from the decode sidecar's ``/status`` (``--decode-sidecar``,
   its ``--http-port``) and adds it to the error it returns.

A client that goes away cancels the handler, which closes the connection to
the engine it is waiting on; vLLM then aborts the request there.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import aiohttp
from aiohttp import web

ROOM_KEY = "pd_transfer_room"


async def completions(request: web.Request) -> web.StreamResponse:
    app, body = request.app, await request.json()
    session: aiohttp.ClientSession = app["session"]
    first = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    first.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    async with session.post(f"{app['prefill']}/v1/completions", json=first) as reply:
        answer = await reply.json(content_type=None)
        if reply.status != 200:
            return web.json_response(answer, status=reply.status)
    params = answer.get("kv_transfer_params")
    second = {**body, "kv_transfer_params": params}
    async with session.post(f"{app['decode']}/v1/completions", json=second) as reply:
        if body.get("stream") and reply.status == 200:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for chunk in reply.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out
        answer = await reply.json(content_type=None)
        status = reply.status
        if any(c.get("finish_reason") == "error" for c in answer.get("choices") or ()):
            answer, status = {"error": {"message": "decode failed the request", "code": 500}}, 500
        if status != 200 and isinstance(params, dict):
            await explain(app, answer, params.get(ROOM_KEY))
        return web.json_response(answer, status=status)


async def explain(app: web.Application, answer: dict, room: object) -> None:
    """Add the decode sidecar's reason for ``room`` to vLLM's error message."""
    error = answer.get("error") if isinstance(answer.get("error"), dict) else answer
    if not app["decode_sidecar"] or not isinstance(error.get("message"), str):
        return
    try:
        async with app["session"].get(f"{app['decode_sidecar']}/status") as reply:
            status = await reply.json(content_type=None)
    except (aiohttp.ClientError, json.JSONDecodeError):
        return
    for entry in status.get("rooms", []):
        if entry.get("room") == room and entry.get("reason"):
            error["message"] += f" (pd-transfer room {room}: {entry['reason']})"


async def main(args: argparse.Namespace) -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.update(prefill=args.prefill, decode=args.decode, decode_sidecar=args.decode_sidecar)
    app["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port).start()
    print(f"proxy listening on {args.port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    parser.add_argument("--decode-sidecar", default="")
    asyncio.run(main(parser.parse_args()))
