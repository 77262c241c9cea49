"""One exception hierarchy for everything kvgate itself rejects, rendered once as OpenAI JSON.

The body shape is vLLM's and OpenAI's: ``{"error": {"message", "type", "param", "code"}}``;
`type` uses vLLM's vocabulary (``AuthenticationError``, ``RateLimitError``, ...) and `code` is
a stable machine-readable string where OpenAI has one (``invalid_api_key``,
``rate_limit_exceeded``) or where kvgate itself refuses for a reason a client may act on
(``queue_shed`` for every request flow control sheds, 429 or 503; ``store_unavailable``,
``version_mismatch``, ...), else the HTTP status, as vLLM answers (its errors, relayed, and
kvgate's for a replica failing, timing out or missing: 502, 504, 503). The proxy, the endpoint
picker, tenancy and the admin API all raise these classes, so every error a client sees from
kvgate or from a replica through it reads the same. Messages are written by us and never
contain prompt text, keys, salts, the server secret or tracebacks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import orjson

__all__ = [
    "NAME_CHARS",
    "REFUSED",
    "REQUEST_FAULT",
    "AdapterGone",
    "AnswerTooLarge",
    "AuthError",
    "BackendUnavailable",
    "BadRequest",
    "BodyNotInTime",
    "BodyTooLarge",
    "ConfigError",
    "Conflict",
    "EncodedBody",
    "FormBody",
    "KvgateError",
    "MethodNotAllowed",
    "ModelNotFound",
    "MultipartBody",
    "NoReplicaAvailable",
    "NotFound",
    "PermissionDenied",
    "PoolOverloaded",
    "PreconditionFailed",
    "QueueShed",
    "RateLimited",
    "RateLimitedBeyondWindow",
    "ReplicaConnectionsBusy",
    "ReplicaRefused",
    "ReplicaWrongModel",
    "RequestFailed",
    "ResponseLookupFailed",
    "RetryBudgetExhausted",
    "ShutDownWhileQueued",
    "ShutDownWhileUploading",
    "StaleCheck",
    "StoreUnreachable",
    "UnreadableRecord",
    "UploadsFull",
    "UpstreamError",
    "UpstreamTimeout",
    "WriteOutcomeUnknown",
    "WriteRefused",
    "error_body",
    "for_status",
    "shown_name",
    "type_for",
]


def error_body(message: str, type_: str, code: int | str | None, param: str | None = None) -> bytes:
    error = {"message": message, "type": type_, "param": param, "code": code}
    return orjson.dumps({"error": error})


class KvgateError(Exception):
    """Base: an error kvgate answers itself. Subclasses fix the status, the OpenAI type and,
    where OpenAI has one, a string `code` (None: the status is the code)."""

    status: int = 500
    type_: str = "InternalServerError"
    code: str | None = None

    def __init__(
        self, message: str, *, param: str | None = None, retry_after: int | None = None,
        reason: str = "error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.reason = reason  # short label for logs and metrics: "missing", "connect", ...

    def body(self) -> bytes:
        code = self.code if self.code is not None else self.status
        return error_body(self.message, self.type_, code, self.param)

    def headers(self) -> list[tuple[bytes, bytes]]:
        hdrs = [(b"content-type", b"application/json")]
        if self.retry_after is not None:
            hdrs.append((b"retry-after", str(self.retry_after).encode()))
        return hdrs


class ConfigError(KvgateError):
    """Invalid configuration at start-up; the message names the field."""


class BadRequest(KvgateError):
    status = 400
    type_ = "BadRequestError"


class AuthError(KvgateError):
    status = 401
    type_ = "AuthenticationError"
    code = "invalid_api_key"


class PermissionDenied(KvgateError):
    status = 403
    type_ = "PermissionDeniedError"
    code = "forbidden"


class NotFound(KvgateError):
    status = 404
    type_ = "NotFoundError"


# of a name a client chose (a model's), echoed in a 404 or logged: a 60 KB name was echoed
# whole in the 404 and written whole in every request's log line
NAME_CHARS = 256


def shown_name(name: str) -> str:
    """`name` as a client's choice is shown or logged: cut at `NAME_CHARS`, with its length."""
    if len(name) <= NAME_CHARS:
        return name
    return name[:NAME_CHARS] + f"... ({len(name)} characters)"


class ModelNotFound(NotFound):
    """vLLM's message, then the public names this gateway offers the caller's tier (the first
    `SHOWN`), and when `model` is a replica's served name (what answers carry in `model`), that
    it is. A model the policy offers only to other tiers (``other_tier``: the caller's) is
    said to be not offered to the caller's tier, not to be missing. `code` is OpenAI's
    ``model_not_found`` (vLLM answers the bare 404), which clients test for."""

    SHOWN = 10
    code = "model_not_found"

    def __init__(
        self, model: str, known: Sequence[str] = (), *, served: bool = False,
        other_tier: str | None = None,
    ) -> None:
        model = shown_name(model)
        message = (f"The model `{model}` is not offered to this key's tier (`{other_tier}`)."
                   if other_tier is not None else f"The model `{model}` does not exist.")
        if served:
            message += (f" `{model}` is the name a replica serves it under (answers carry it"
                        " in `model`); send the public model name instead.")
        if known:
            names = ", ".join(known[:self.SHOWN])
            more = f" and {len(known) - self.SHOWN} more" if len(known) > self.SHOWN else ""
            message += f" Models served here: {names}{more} (GET /v1/models lists them)."
        super().__init__(message, param="model")


class MethodNotAllowed(KvgateError):
    status = 405
    type_ = "MethodNotAllowedError"

    def __init__(self, message: str, *, allow: str | None = None) -> None:
        super().__init__(message)
        self.allow = allow  # the `Allow` header (RFC 9110): the methods the path takes

    def headers(self) -> list[tuple[bytes, bytes]]:
        hdrs = super().headers()
        if self.allow is not None:
            hdrs.append((b"allow", self.allow.encode()))
        return hdrs


class Conflict(KvgateError):
    status = 409
    type_ = "ConflictError"
    code = "conflict"


class UnreadableRecord(Conflict):
    """A stored record asked for by name (the admin API) that this process cannot read:
    corrupted, or in a form this version does not know. The message names the way out, never
    the stored value."""

    code = "record_unreadable"


class StaleCheck(Conflict):
    """A write checked against another object that changed before it was stored (a tenant's
    tier against the policy, a policy against the tenants' tiers): nothing was written; check
    again and retry (the admin routes do)."""


class PreconditionFailed(KvgateError):
    """An admin write whose expected version is not the stored one."""

    status = 412
    type_ = "PreconditionFailedError"
    code = "version_mismatch"


class BodyNotInTime(KvgateError):
    """The HTTP edge's 408 (`gateway/httpguard.py`) as the Envoy picker gives it: a request
    body not complete `server.body_timeout_s` after its headers. Behind Envoy nothing else
    bounds it (Envoy's stream idle timeout restarts with each byte), and a body held open
    keeps its share of `server.max_pending_body_bytes`."""

    status = 408
    type_ = "RequestTimeoutError"


class BodyTooLarge(KvgateError):
    status = 413
    type_ = "RequestEntityTooLargeError"


class EncodedBody(KvgateError):
    """A request body sent with a `Content-Encoding` (gzip, ...): kvgate reads bodies as they
    are (a decompressed body could be any size), so the client hears that, not that its bytes
    are not JSON. RFC 9110's answer: 415 naming the one coding taken in `Accept-Encoding`."""

    status = 415
    type_ = "UnsupportedMediaTypeError"

    def __init__(self) -> None:
        super().__init__("Compressed request bodies (Content-Encoding) are not accepted; send "
                         "the body uncompressed.")

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers(), (b"accept-encoding", b"identity")]


class RateLimited(KvgateError):
    status = 429
    type_ = "RateLimitError"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message, retry_after=max(1, math.ceil(retry_after_s)))
        self.retry_after_s = retry_after_s


class UpstreamError(KvgateError):
    """The chosen replicas failed before answering (connect error, reset, 5xx)."""

    status = 502
    type_ = "BadGatewayError"

    def __init__(self, message: str, *, reason: str = "error") -> None:
        super().__init__(message, reason=reason)  # "connect", "status_503", ...


class AdapterGone(UpstreamError):
    """A replica's 404 for a LoRA adapter it no longer has while another replica is still
    listed with it: that one is tried. With no try left (`upstream.max_attempts`, the retry
    budget) the proxy relays this 404 (`answer`, "The model `x` does not exist."): the
    request's model is gone there, and a 502 in its place was retried twice by the SDKs."""

    def __init__(self, answer: bytes) -> None:
        super().__init__("The replica no longer serves this LoRA adapter.",
                         reason="no_adapter")
        self.answer = answer


class UpstreamTimeout(UpstreamError):
    """A first-byte, idle or total timeout (`code` 504, `type` says timeout)."""

    status = 504
    type_ = "GatewayTimeoutError"

    def __init__(self, message: str, *, reason: str = "timeout") -> None:
        super().__init__(message, reason=reason)


# a replica refusing kvgate's own credentials (vLLM's --api-key middleware answers 401)
REFUSED = frozenset({401, 403})


# the reason of a stream's failure that is its request's own
# (`gateway.relay_whole.WholeRelay._suspect`): not retried
REQUEST_FAULT = "request_error_event"


class RequestFailed(UpstreamError):
    """A stream that failed with vLLM's 500 error event for its request on two replicas: the
    request fails wherever it runs, a 502 the SDKs are told not to retry (theirs would run
    the prompt again where it fails, after kvgate's own retry on another replica)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason=REQUEST_FAULT)

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers(), (b"x-should-retry", b"false")]


class ReplicaRefused(UpstreamError):
    """A replica answered 401/403: it refused kvgate's own credentials (vLLM's ``--api-key``
    without the pool's `api_key_env`, or another key). The client's key is kvgate's and was
    accepted, so passing the 401 on would tell the client the wrong thing: a 502."""

    def __init__(self, status: int) -> None:
        super().__init__(
            f"The replica refused the gateway's credentials (it answered {status}): the gateway "
            "is misconfigured, your API key is not at fault.", reason="refused")

    def headers(self) -> list[tuple[bytes, bytes]]:
        # the official OpenAI SDKs read x-should-retry before their status rules (which retry
        # every 5xx): trying again cannot help until an operator fixes the pool's key
        return [*super().headers(), (b"x-should-retry", b"false")]


class ReplicaWrongModel(UpstreamError):
    """A replica answered vLLM's 404 "The model `...` does not exist." for the pool's served
    model: it serves another model (restarted with a different one, or listed in the wrong
    pool). The name was kvgate's, from a public model it offers, so the client's choice is
    not at fault: a 502, never the 404 that would say so."""

    def __init__(self) -> None:
        super().__init__(
            "The replica does not serve this pool's model (it answered 404): the gateway's "
            "pool is misconfigured, your model name is not at fault.", reason="wrong_model")


class AnswerTooLarge(KvgateError):
    """A replica's whole answer, or one event of its stream, is larger than
    ``upstream.max_answer_bytes``: kvgate stops reading it (held whole, it could take the
    gateway's memory, and every other request with it). Not retried elsewhere: another
    replica would answer the same request as largely."""

    status = 502
    type_ = "BadGatewayError"

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"The replica's answer is larger than the gateway accepts ({limit} bytes, "
            "upstream.max_answer_bytes); ask for less, or stream it.", reason="too_large")

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers(), (b"x-should-retry", b"false")]


class RetryBudgetExhausted(UpstreamError):
    """Replicas answered busy/failed and the pool's retry budget allows no further attempt:
    503 with Retry-After (a client may try again shortly), not a 502."""

    status = 503
    type_ = "ServiceUnavailableError"

    def __init__(self, message: str, *, reason: str = "retry_budget") -> None:
        super().__init__(message, reason=reason)
        self.retry_after = 1


class QueueShed(RateLimited):
    """Shed from flow control's queue: its tier's longest wait, or displaced (429)."""

    code = "queue_shed"


class BackendUnavailable(KvgateError):
    """The shared store (Redis) cannot be reached, or cached state is too stale to trust:
    a 503 with Retry-After (a store comes back; the client should retry)."""

    status = 503
    type_ = "ServiceUnavailableError"
    code = "store_unavailable"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message, retry_after=retry_after)


# Redis's refusals that retrying does not cure (`redis_conn.failure_cause` names them: a reply's
# first word, or redis-py's class for a refused AUTH): what the 503 says to the operator
_REFUSALS = {
    "OOM": "it is out of memory (maxmemory reached under noeviction)",
    "READONLY": "it is a read-only replica (KVGATE_REDIS_URL must name the primary)",
    "WRONGTYPE": "a key kvgate uses holds another type (something else writes under "
                 "tenancy.namespace)",
    "MISCONF": "it cannot save its data to disk",
    "NOAUTH": "it asks for a password KVGATE_REDIS_URL does not give",
    "WRONGPASS": "it refused the password in KVGATE_REDIS_URL",
    "NOPERM": "its ACL user lacks a permission kvgate needs",
    "AuthenticationError": "it refused kvgate's credentials",
}


def _reply_code(cause: str) -> str:
    """``WRONGPASS`` of ``server replied WRONGPASS: authentication failed (...)``: the words
    after the code explain it for the log, never for a client."""
    return cause.removeprefix("server replied ").split(":", 1)[0]


class StoreUnreachable(BackendUnavailable):
    """A Redis failure. Its cause in a few words (``connection refused``) is for the log
    only: the client's message names neither it nor Redis's address; a refusal of Redis's
    own that retrying does not cure (out of memory, a read-only replica, a key of the wrong
    type, a refused password) is named by its code, which holds no secret, and explained: it
    was "did not answer; retry shortly", while Redis answered, and would refuse again."""

    def __init__(self, cause: str) -> None:
        code = _reply_code(cause)
        why = _REFUSALS.get(code)
        super().__init__(
            "the tenancy store (Redis) did not answer; retry shortly" if why is None else
            f"the tenancy store (Redis) refused the request ({code}): {why}; the gateway's "
            "log has the details")
        self.cause = cause


class UploadsFull(KvgateError):
    """Request bodies still arriving hold `server.max_pending_body_bytes` already: a 503 with
    Retry-After (the gateway's memory, not the client's limits)."""

    status = 503
    type_ = "ServiceUnavailableError"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message, retry_after=retry_after)


class NoReplicaAvailable(KvgateError):
    status = 503
    type_ = "ServiceUnavailableError"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message, retry_after=retry_after)


class ShutDownWhileQueued(NoReplicaAvailable):
    """The shutdown grace ended while the request waited in flow control's queue: a 503
    recorded as "interrupted" like any request the grace cut (`gateway.drain`), not as flow
    control's "shed" (no shed was counted for it)."""


class PoolOverloaded(NoReplicaAvailable):
    """Flow control: the pool's queue is full of requests at least as important as a top-band
    one (503). Its `code` is `QueueShed`'s: every request flow control sheds says so alike."""

    code = "queue_shed"


def unserved_route(path: str) -> str:
    """Why a replica has no `path`: vLLM registers a route only for a model that can serve it
    (embeddings for an embedding model, chat and completions for a generative one)."""
    kind = "an embedding (pooling)" if path == "/v1/embeddings" else "a generative"
    return (f"This model does not serve {path}: its replicas answered 404 (vLLM serves {path} "
            f"only for {kind} model). GET /v1/models lists the models served here.")


# HTTP status -> OpenAI/vLLM error type, for upstream errors kvgate has to re-shape
_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
          404: "NotFoundError", 405: "MethodNotAllowedError", 409: "ConflictError",
          413: "RequestEntityTooLargeError", 422: "UnprocessableEntityError",
          429: "RateLimitError", 500: "InternalServerError", 501: "NotImplementedError",
          502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}


def type_for(status: int) -> str:
    """The OpenAI/vLLM error type of an HTTP status."""
    return _TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


def for_status(status: int, message: str) -> KvgateError:
    """An error with ``status`` and its OpenAI type (for statuses no class above names)."""
    error = KvgateError(message)
    error.status = status
    error.type_ = type_for(status)
    return error


class ShutDownWhileUploading(NoReplicaAvailable):
    """The shutdown grace ended while the request's body was still arriving (a slow upload):
    a 503 the client can retry elsewhere, instead of the bare text/plain 500 the server gives
    a request whose task is cancelled at exit before it answered (`request.read_body`)."""


class WriteOutcomeUnknown(StoreUnreachable):
    """An admin write the tenancy store (Redis) did not answer, or refused, before its answer
    was made: Redis may have run it (then answered too late, or the connection dropped after
    it), may still run it (a command waiting in a paused Redis), or never did. The 503 says
    so and names the admin request's id (its `X-Request-Id`), which the write's audit entry
    carries: the Redis store writes the entry in the same script as the change, so the change
    was made exactly when `GET /admin/audit` lists an entry with that `request_id`."""

    def __init__(self, cause: str, request_id: str) -> None:
        super().__init__(cause)
        self.message = (
            f"{self.message.removesuffix('; retry shortly')}: this change may have been "
            "applied, or may still be if Redis runs it late. Read the object back before "
            f"retrying; the audit log (GET /admin/audit) has an entry with request_id "
            f"{request_id!r} if and only if the change was made (send a new X-Request-Id on "
            "each retry)")
        self.args = (self.message,)


class ReplicaConnectionsBusy(UpstreamError):
    """The request waited `upstream.connection_wait_s` in kvgate for one of its replica's
    `upstream.max_connections` connections, all carrying other requests: the replica is busy,
    not failing (it is not charged), and the request never reached it. Another replica is
    tried; the last try's is a 503 with Retry-After."""

    status = 503
    type_ = "ServiceUnavailableError"

    def __init__(self) -> None:
        super().__init__(
            "The replica's connections (upstream.max_connections) all stayed in use for "
            "upstream.connection_wait_s: the replica is busy; try again shortly.",
            reason="connection_wait")
        self.retry_after = 1


class WriteRefused(StoreUnreachable):
    """An admin write refused by a Redis that refuses every write while the condition lasts: a
    read-only replica (after a failover, the URL still naming the old primary), out of memory
    under noeviction, a failed save (MISCONF), refused credentials. A script's first write is
    refused whole and the script stops, so the change was not made; the 503 says so (it said
    "may have been applied, or may still be if Redis runs it late", as for a timeout), and
    still names the audit entry for a refusal that began during a write of several calls."""

    CODES = frozenset({"OOM", "READONLY", "MISCONF", "NOAUTH", "WRONGPASS",
                       "AuthenticationError"})

    @classmethod
    def covers(cls, cause: str) -> bool:
        return _reply_code(cause) in cls.CODES

    def __init__(self, cause: str, request_id: str) -> None:
        super().__init__(cause)
        self.message = (
            f"{self.message}: Redis refuses every write while this lasts, so this change was "
            "not made (the audit log, GET /admin/audit, has an entry with request_id "
            f"{request_id!r} if and only if it was)")
        self.args = (self.message,)


class MultipartBody(KvgateError):
    """A POST to a proxied route declared ``multipart/form-data`` (``curl -F``, a file
    upload): the routes take JSON, and a form's bytes would be judged "not valid JSON" at
    its boundary line. Refused before the body is read, as vLLM refuses any body not
    declared JSON (415, its ``validate_json_request``). Only the audio routes take a form, at
    the HTTP edge (``gateway.multipart``); behind Envoy the picker routes none."""

    status = 415
    type_ = "UnsupportedMediaTypeError"

    def __init__(self, path: str, *, envoy: bool = False) -> None:
        if envoy and path.startswith("/v1/audio/"):
            tail = ("; behind Envoy kvgate routes no file upload: send audio to kvgate's "
                    "HTTP edge (kvgate serve).")
        else:
            tail = (" (file uploads go to /v1/audio/transcriptions and "
                    "/v1/audio/translations).")
        super().__init__(f"{shown_name(path)} takes a JSON body (Content-Type: "
                         f"application/json), not multipart/form-data{tail}")


class FormBody(KvgateError):
    """A POST to a proxied route declared ``application/x-www-form-urlencoded`` whose body
    is a form (``model=...&prompt=...``), not JSON: 415 as vLLM answers any body not declared
    JSON (its ``validate_json_request``), naming JSON, rather than a 400 "not valid JSON" at
    the first byte. A JSON body declared a form (``curl -d '{...}'``) is read as JSON."""

    status = 415
    type_ = "UnsupportedMediaTypeError"

    def __init__(self, path: str) -> None:
        super().__init__(f"{shown_name(path)} takes a JSON body (Content-Type: "
                         "application/json), not form fields (application/"
                         "x-www-form-urlencoded).")


class RateLimitedBeyondWindow(RateLimited):
    """A 429 whose wait is longer than a limit's window (a minute): the tenant owes more than
    its whole budget (one request of 1,500 tokens on a 600 TPM budget is admitted, the
    bucket's balance being above zero, and the next ones wait 90 s). ``x-should-retry:
    false``: the openai SDKs retry a 429 twice, sleeping the ``Retry-After`` in the call when
    it is at most 60 s (v1) or 120 s (later), else after their own back-off of a second or
    so, refused again. The client gets the wait at once and decides (the 429 still says
    when)."""

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers(), (b"x-should-retry", b"false")]


class ResponseLookupFailed(BackendUnavailable):
    """A Responses API id this gateway did not relay could not be looked up in the shared
    store (Redis down, or no answer within its timeout): whose it is, and where it lives,
    is unknown. A 503 to retry, not the 404 that would tell the client its conversation is
    gone; never sent on to a replica, whose store would continue another tenant's response
    of that id."""

    code = "response_lookup_failed"

    def __init__(self, rid: str) -> None:
        super().__init__(f"The gateway could not look up the response with id "
                         f"'{shown_name(rid)}' (its shared store, Redis, did not answer); "
                         "retry shortly.")
