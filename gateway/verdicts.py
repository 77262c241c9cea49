"""What an upstream answer says about its replica, by the same rules at both edges (the HTTP
proxy's `Relay` and the Envoy picker's answer side). What the upstream
answered feeds the replica's health (`judge`):

- vLLM's busy 503 ("engine is currently busy", "prefill token backlog"), or a 429 (from a
  limiter in front of the replica): a short back-off from new picks (`Replica.record_busy`);
- vLLM's 503 for a sleeping model (older vLLM, `model_sleeping`): asleep, out of rotation
  until a later request finds it awake (`Replica.record_sleeping`), not a failure;
- 401/403: the replica refused kvgate's own credentials (a pool without the replica's
  ``--api-key``): down at once, as every request would fail there (the client gets a 502,
  `ReplicaRefused`);
- vLLM's dead-engine 500 (``InternalServerError`` "The server had an error while processing
  your request.", the server exits right after): down at once (`Replica.mark_down`);
- vLLM's 404 "The model `...` does not exist.": the replica serves another model than its
  pool's (kvgate sent the pool's served name): down at once, and the request is answered by
  another replica (`ReplicaWrongModel`, a 502, when none is left) -- else, fast, unloaded
  and holding the prefixes routed to it, it drew traffic it fails every time -- unless the
  model it names is a LoRA adapter its cards listed (unloaded there since): the adapter is
  forgotten there, the 404 relayed, the replica untouched (`Pool.unloaded`);
- any other 5xx, e.g. ``EngineFaultedError``'s 503 while ``/health`` stays 200, and a stream
  that ends with an error event of code >= 500 (vLLM's mid-stream engine death), ends
  before it is complete (no ``data: [DONE]`` nor Responses API terminal event: the client gets
  an error event) or stalls: a failure (consecutive failures eject);
- a 200 that is not JSON, or not the stream the client asked for, or a 2xx other than 200
  or a 3xx (`not_an_answer`: vLLM answers 200 or an error): a failure, retried elsewhere
  (nothing reached the client yet), else a 502; so is a 2xx/3xx to a stream an
  earlier try's keep-alive comments opened: the client's stream ends with a 502 event;
- a stream event whose data is neither JSON nor ``[DONE]`` (`StreamScanner.malformed`): a
  failure, never forwarded; before the stream reached the client (its head goes out with the
  first read that holds events; good events before the bad one in that read are not sent) it
  is retried elsewhere (`unstarted_failure`), after it the stream ends with a 502 error event
  and ``[DONE]`` (as a stream cut short); so is a first read holding vLLM's error event of
  code >= 500 (its engine failed before answering);
- anything else: a success.

A 429's Retry-After (`retry_seconds`, `busy_wait`, `relayed_retry_after`) sets the replica's
busy back-off and the client's Retry-After.
"""

from __future__ import annotations

import logging
import math
import re

from gateway.errors import REFUSED, KvgateError, UpstreamError
from gateway.pool import Pool
from gateway.replicas import Replica
from gateway.sse import StreamScanner
from gateway.upstream_errors import model_sleeping

__all__ = ["ENGINE_DIED", "alone_with_error_event", "busy_wait", "dead_event", "engine_died",
           "internal_error", "judge", "no_other_replica", "not_an_answer",
           "not_what_was_asked", "relayed_retry_after", "retry_seconds", "served"]

log = logging.getLogger(__name__)

# vLLM's admission-control 503s (v1 engine: --max-num-queued-reqs / --max-num-queued-tokens)
_BUSY = (b"currently busy", b"backlog limit")
# vLLM's answer once its engine died (exception_handling/error_response.py)
_DEAD = b"The server had an error while processing your request"
ENGINE_DIED = "The replica's engine died (it answered 500); try again shortly."
# vLLM's 404 for a model it does not serve (`The model `x` does not exist.`)
_NO_MODEL = re.compile(rb"The model `([^`]*)` does not exist")


def not_what_was_asked(stream: bool, content_type: str) -> UpstreamError:
    """A 200 that is not the stream asked for, or (not a stream) not JSON: an HTML page from
    whatever answers at the replica's address, a whole answer to a stream. Both edges: a
    failure of the replica, the 502 (relayed, the SDK got a str, or an empty stream that looks
    complete)."""
    media = content_type.partition(";")[0].strip()[:64] or "no content type"
    what = "the stream asked for" if stream else "JSON"
    return UpstreamError(f"The replica's answer is not {what} ({media}).", reason="not_json")


def not_an_answer(status: int) -> UpstreamError:
    """A proxied route answered 2xx other than 200, or 3xx: not vLLM's (it answers 200 or an
    error), and nothing an SDK can read. Both edges: a failure of the replica, the 502."""
    return UpstreamError(f"The replica answered {status}, not an answer.",
                         reason=f"status_{status}")


def internal_error(status: int, body: bytes) -> bool:
    """vLLM's 500 for one request (an exception while serving it: `GenerationError`, a
    template or parser bug, ...), not its dead engine's (`judge`): the replica or the request
    may be at fault, and the same request elsewhere tells which (`Proxy._forward`)."""
    return status == 500 and _DEAD not in body


def no_other_replica(pool: Pool, replica: Replica, now: float) -> bool:
    """No replica of `pool` but `replica` may be sent a request now: an internal 500 there
    (`internal_error`) cannot be tried elsewhere to tell whose fault it is, and charging it
    ejected a pool's last replica for a request that fails anywhere (every tenant then got
    503s, and the replica serves other requests well). Both edges relay it uncharged."""
    return not any(r is not replica and r.available(now) for r in pool.replicas)


def alone_with_error_event(
    pool: Pool, replica: Replica, scanner: StreamScanner, now: float,
) -> bool:
    """A stream's 5xx error event, not a dead engine's (as `internal_error` tells a whole
    answer's), from the pool's only replica that takes requests: not charged
    (`no_other_replica`; both edges)."""
    return (scanner.error_code is not None and scanner.error_code >= 500
            and not dead_event(scanner) and no_other_replica(pool, replica, now))


def dead_event(scanner: StreamScanner) -> bool:
    return _DEAD in (scanner.error_message or "").encode()


def engine_died(pool: Pool, model: str, now: float) -> KvgateError:
    """The answer to a request whose only try left met vLLM's dead-engine 500 (the replica
    is down now): the pool's 503 with Retry-After when no replica is left -- what the next
    request gets --, else a 502 saying so; never the engine's 500, which only the first
    request of an outage would see (both edges)."""
    if not pool.takes_requests(now):
        return pool.none_healthy(model, now)
    return UpstreamError(ENGINE_DIED, reason="dead")


def judge(
    replica: Replica, status: int, body: bytes, now: float, retry_after: str | None = None,
    pool: Pool | None = None,
) -> str:
    """Feed an upstream answer's status (error body, `retry_after`: its Retry-After header)
    to the replica's health; returns the verdict ("busy", "refused", "dead", "wrong_model",
    "failure", "ok"; "no_adapter": its 404 for a LoRA adapter of `pool` it no longer has,
    a 404 for the request's model, not a replica serving another) for logs and metrics."""
    if status == 429 or (status == 503 and any(marker in body for marker in _BUSY)):
        replica.record_busy(now, retry_seconds(retry_after))
        return "busy"
    if model_sleeping(status, body):
        replica.record_sleeping(now)
        return "asleep"
    if status in REFUSED:
        if not replica.refusal_warned:  # one warning, not one per health cycle
            replica.refusal_warned = True
            log.warning("replica refused the gateway's credentials (%d): set the pool's "
                        "api_key_env to its --api-key", status,
                        extra={"pool": replica.pool, "replica": replica.id})
        replica.mark_down(now)  # (warned above, once: not every health cycle it is back)
        replica.reason = f"refused the gateway's credentials ({status})"
        return "refused"
    if status == 500 and _DEAD in body:
        replica.mark_down(now, reason="its engine died (500)")
        return "dead"
    if status == 404 and (named := _NO_MODEL.search(body)):
        if pool is not None and pool.unloaded(replica.id, named[1].decode("utf-8", "replace")):
            return "no_adapter"  # a LoRA adapter unloaded there: not sent there again
        replica.mark_down(now, reason="serves another model (404)")
        return "wrong_model"
    if status >= 500:
        replica.record_failure(now)
        return "failure"
    served(replica)
    return "ok"


def served(replica: Replica) -> None:
    """`replica` answered a request well: healthy, and a later refusal is warned about."""
    replica.refusal_warned = False
    replica.record_success()


_MAX_RETRY_AFTER_S = 3_600


def retry_seconds(sent: str | None) -> int | None:
    """A Retry-After header's seconds when it is a positive whole number, capped at an hour
    (the SDKs wait what it says); None otherwise (absent, an HTTP date, a fraction, a negative
    number, garbage): the usual back-off then. ``0`` is None too: taken as said, the replica
    got no back-off at all and was asked again at once, request after request, and the
    client was told to retry at once. Only ASCII digits are a number (``str.isdigit`` takes
    ``²``, which `int` refuses), and a long one is the cap without `int` (which refuses over
    4300 digits): a replica's header never makes the client's answer a 500."""
    sent = (sent or "").strip()
    if not (sent.isascii() and sent.isdigit()):
        return None
    digits = sent.lstrip("0")
    if not digits:
        return None
    if len(digits) > len(str(_MAX_RETRY_AFTER_S)):
        return _MAX_RETRY_AFTER_S
    return min(int(digits), _MAX_RETRY_AFTER_S)


def busy_wait(replica: Replica, sent: str | None, now: float) -> int:
    """Whole seconds until `replica`, which answered 429, may take the request (both
    edges): what its Retry-After (`sent`) said, else its busy back-off left, at least 1."""
    said = retry_seconds(sent)
    return said if said is not None else max(1, math.ceil(replica.busy_until - now))


def relayed_retry_after(status: int, sent: str | None, wait: int | None = None) -> bytes | None:
    """The Retry-After a relayed 429/503 carries (both edges): for a 429, `wait` (the
    soonest any replica it tried takes it again: `busy_wait`); else the replica's own `sent`
    when it is a number of seconds (`retry_seconds`), else 1 s for a 503."""
    if status == 429 and wait is not None:
        return str(wait).encode()
    if status not in (429, 503):
        return None
    said = retry_seconds(sent)
    if said is not None:
        return str(said).encode()
    return b"1" if status == 503 else None
