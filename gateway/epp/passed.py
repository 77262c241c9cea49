"""The endpoints Envoy went past before one answered: charged a failure (not for vLLM's 500
for the request: they most likely failed it alike, `AnswerSide._answered_whole`), but Envoy
also goes past an endpoint whose connection was refused, and tells the picker neither which
nor why. The HTTP edge marks a replica down at once when its connection is refused
(`Proxy._attempt`); the picker asks each such endpoint for a connection itself -- once the
answer went out, or before answering when the last one's was refused too
(`Deadlines.router_reset`) -- and marks down those that refuse it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from gateway.replicas import Replica
from gateway.transport import connect_failure, refused

__all__ = ["PROBE_S", "SETTLE_S", "mark_refused"]

log = logging.getLogger(__name__)

# how long a connection is waited for by a probe that holds an answer (a refusal comes within
# a round trip; a slow connect is no refusal)
PROBE_S = 1.0


# how long a connection taken is watched for a reset when the replica may be exiting (a killed
# process's connections were just cut): the kernel completes a connect to its listener until
# the exit closes it, then resets the connections not accepted yet
SETTLE_S = 0.25


async def _refuses(
    replica: Replica, within_s: float, settle_s: float,
) -> BaseException | None:
    """The error of a connection to `replica` that nothing took, or that was reset within
    `settle_s` of being taken (None: it was taken, or slow: not a refusal)."""
    where = urlsplit(replica.url)
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(where.hostname, where.port or 80), within_s)
    except (OSError, TimeoutError) as exc:
        return exc if refused(exc) else None
    try:
        if settle_s > 0:
            await asyncio.wait_for(reader.read(1), settle_s)
    except ConnectionResetError as exc:
        return exc
    except (OSError, TimeoutError):
        pass
    finally:
        writer.close()
    return None


async def mark_refused(
    replicas: Sequence[Replica], within_s: float, clock: Callable[[], float],
    settle_s: float = 0.0,
) -> list[Replica]:
    """Mark down each of `replicas` that refuses a connection now (or resets it within
    `settle_s`); those are returned."""
    errors = await asyncio.gather(*(_refuses(r, within_s, settle_s) for r in replicas))
    down = []
    for replica, exc in zip(replicas, errors, strict=True):
        if exc is not None:
            down.append(replica)
            replica.mark_down(clock(), gone=True)
            replica.reason = connect_failure(exc, replica.url)
            log.info("replica did not answer", extra={"replica": replica.id,
                                                      "reason": replica.reason})
    return down
