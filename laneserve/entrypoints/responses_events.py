"""The Responses API's streamed events, in OpenAI's order (see responses_api.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from laneserve.entrypoints.api_errors import error_for
from laneserve.entrypoints.responses_run import Run, message_item, sse_event
from laneserve.entrypoints.streams import merged
from laneserve.frontend.output_processor import Delta


class Sequence:
    """Numbers each event (`sequence_number`) and frames it as SSE."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, **fields: object) -> bytes:
        body = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        return sse_event(body)


async def events(
    run: Run, streams: list, record: Callable[[Delta, dict[int, float]], None]
) -> AsyncIterator[bytes]:
    ev = Sequence()
    yield ev("response.created", response=run.response("in_progress", []))
    yield ev("response.in_progress", response=run.response("in_progress", []))
    live = run.tools is None  # NOTE: with tools, items are known only at the end
    if live:
        for chunk in _open_message(ev, run):
            yield chunk
    clock: dict[int, float] = {}
    try:
        async for _, d in merged(streams):
            run.add(d)
            record(d, clock)
            if live and d.text:
                yield ev(
                    "response.output_text.delta",
                    item_id=run.msg_id,
                    output_index=0,
                    content_index=0,
                    delta=d.text,
                    logprobs=[],
                )
    except Exception as e:
        run.error = error_for(e).message
    if run.error:
        yield ev("response.failed", response=run.response("failed", []))
        return
    items = run.items()
    for index, item in enumerate(items):
        for chunk in _item_events(ev, run, index, item, opened=live):
            yield chunk
    status = run.status()
    kind = "response.completed" if status == "completed" else "response.incomplete"
    yield ev(kind, response=run.response(status, items))


def _open_message(ev: Sequence, run: Run) -> list[bytes]:
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    return [
        ev(
            "response.output_item.added",
            output_index=0,
            item=message_item(run.msg_id, "", "in_progress"),
        ),
        ev(
            "response.content_part.added",
            item_id=run.msg_id,
            output_index=0,
            content_index=0,
            part=part,
        ),
    ]


def _item_events(ev: Sequence, run: Run, index: int, item: dict, opened: bool) -> list[bytes]:
    """The events that finish one output item (and open it, unless already open)."""
    out: list[bytes] = []
    if item["type"] == "message":
        if not opened:
            out += _open_message(ev, run)
            text = item["content"][0]["text"]
            if text:
                out.append(
                    ev(
                        "response.output_text.delta",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        delta=text,
                        logprobs=[],
                    )
                )
        part = item["content"][0]
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        out.append(ev("response.output_text.done", **ids, text=part["text"], logprobs=[]))
        out.append(ev("response.content_part.done", **ids, part=part))
    else:
        added = {**item, "arguments": "", "status": "in_progress"}
        out.append(ev("response.output_item.added", output_index=index, item=added))
        ids = {"item_id": item["id"], "output_index": index}
        out.append(ev("response.function_call_arguments.delta", **ids, delta=item["arguments"]))
        out.append(ev("response.function_call_arguments.done", **ids, arguments=item["arguments"]))
    out.append(ev("response.output_item.done", output_index=index, item=item))
    return out
