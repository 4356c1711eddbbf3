"""Per-request stream plumbing for the server: merge the prompts' delta streams,
close (abort) them however a response ends, and notice a client that left."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from laneserve.frontend.output_processor import Delta


async def close_all(streams: list) -> None:
    for s in streams:
        await s.aclose()  # NOTE: aborts the request unless it finished


class SSEResponse(StreamingResponse):
    """An SSE response that closes (aborts) its streams however it ends, even
    when the client left before the first chunk was asked for."""

    def __init__(self, content: AsyncIterator[bytes], streams: list) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await close_all(self.streams)


async def merged(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """Interleave the per-prompt streams as their deltas arrive."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s) -> None:
        # NOTE: each pump owns its stream: closing it here (also on cancel) aborts it
        try:
            async for d in s:
                await q.put((i, d))
            await q.put((i, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await q.put((i, e))
        finally:
            await s.aclose()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    live = len(tasks)
    try:
        while live:
            i, item = await q.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def client_left(request: Request) -> None:
    """Returns when the client disconnects (the body was read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
