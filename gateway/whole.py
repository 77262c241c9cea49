"""Reading a whole (non-streamed) upstream answer: bounded in size, and timed between its
chunks. The HTTP edge's proxied answers and stored responses read with it (`relay.py`
re-exports it); the endpoint picker reads Envoy's copy of one by the same rule."""

from __future__ import annotations

from collections.abc import Callable

from gateway.errors import AnswerTooLarge
from gateway.transport import UpstreamResponse

__all__ = ["read_whole"]


async def read_whole(
    resp: UpstreamResponse, limit: int, touch: Callable[[], None] | None = None,
) -> bytes:
    """A whole answer, `AnswerTooLarge` past ``limit`` bytes (declared or read): the caller
    then drops the connection, so the replica stops sending. ``touch`` is called at each
    chunk (`Canceller.touch`): the idle timeout bounds the gaps between a body's chunks, not
    its whole transfer, so a slow but moving body is not cut."""
    declared = resp.content_length
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise AnswerTooLarge(limit)
    parts, size = [], 0
    while chunk := await resp.read_chunk():
        if touch is not None:
            touch()
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(limit)
        parts.append(chunk)
    return b"".join(parts)
