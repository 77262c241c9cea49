"""The simulated replica's HTTP surface as one raw ASGI app (vLLM 0.34's paths and shapes)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import itertools
import logging
import math
import struct
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import orjson
import xxhash

from loadtest.sim.asgi import ClientGone, Receive, Scope, Send, read_body, send_bytes, send_json
from loadtest.sim.chat_format import ChatFormat
from loadtest.sim.control import SimControl
from loadtest.sim.devmode import DevRoutes
from loadtest.sim.engine import Engine
from loadtest.sim.errors import SimError, dead_engine_error, engine_faulted_error, error_body
from loadtest.sim.extra_routes import ExtraRoutes
from loadtest.sim.faults import Faults
from loadtest.sim.generate import ConnectionDropped, Format, Generation, ServeContext
from loadtest.sim.inputs import check_vocabulary, prompt_items
from loadtest.sim.loadreport import load_report_header
from loadtest.sim.lora import LoraAdapters
from loadtest.sim.metrics import CONTENT_TYPE, SimMetrics
from loadtest.sim.parse import (
    GenRequest,
    item_prompt,
    parse_generation,
    parse_prompt,
    validate_cache_salt,
)
from loadtest.sim.poison import poisoned
from loadtest.sim.responses import ResponsesAPI
from loadtest.sim.runner import EngineRunner

__all__ = ["SimApp", "SimOptions"]

log = logging.getLogger(__name__)
VLLM_VERSION = "0.34.0"
# the paths vLLM's --api-key middleware checks (entrypoints/serve/middleware/authenticate.py)
_KEYED = ("/v1", "/v2", "/inference", "/cohere")
BUSY = ("The engine is currently busy and cannot accept new requests. Please try again later or "
        "on a different instance.")


@dataclass(frozen=True, slots=True)
class SimOptions:
    model: str  # the (first) served name: in answers and metrics
    aliases: tuple[str, ...] = ()  # the other --served-model-name values, accepted and listed
    root: str | None = None  # the cards' `root` (vLLM's model path; None: `model`)
    time_scale: float = 1.0
    legacy_errors: bool = False
    legacy_metrics: bool = False
    api_keys: tuple[str, ...] = ()
    request_log_size: int = 256
    embedding_dim: int = 256
    request_id_headers: bool = False
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details
    reasoning: bool = False  # --reasoning: chat output starts with a thinking phase
    keep_alive_s: float = 0.0  # --sse-keep-alive-interval
    log_stats: bool = True  # False: --disable-log-stats
    enable_store: bool = False  # --enable-store / VLLM_ENABLE_RESPONSES_API_STORE
    server_load_tracking: bool = False  # --enable-server-load-tracking (GET /load)
    enable_lora: bool = False  # --enable-lora (or --lora-modules): adapters, loaded at run time
    lora_modules: tuple[tuple[str, str], ...] = ()  # --lora-modules name=path
    max_loras: int = 1  # --max-loras (vLLM's default: 1), shown in vllm:lora_requests_info
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1: /sleep, /wake_up, /is_sleeping, ...


Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


class SimApp:
    """Owns the engine runner, metrics, faults and the request log for one replica."""

    def __init__(self, engines: Engine | Sequence[Engine], options: SimOptions,
                 faults: Faults) -> None:
        self.engines = [engines] if isinstance(engines, Engine) else list(engines)
        self.engine = self.engines[0]  # the config is the same for every engine
        self.options, self.faults = options, faults
        self.lora = LoraAdapters(options.enable_lora, options.model, dict(options.lora_modules),
                                 options.max_loras)
        self.metrics = SimMetrics(self.engines, options.model, options.legacy_metrics,
                                  options.log_stats, lambda: faults.sleeping,
                                  self.lora.info if options.enable_lora else None)
        self.runners = [EngineRunner(e, options.time_scale, self.metrics.observer(i))
                        for i, e in enumerate(self.engines)]
        for runner in self.runners:  # `--engine-hang`: hung from the start
            runner.hold(faults.engine_held)
        self.ctx = ServeContext(faults, options.model, self.engine.config.block_size,
                                options.legacy_errors, options.prompt_tokens_details,
                                options.keep_alive_s)
        self.responses = ResponsesAPI(self)
        self.requests: deque[dict[str, Any]] = deque(maxlen=options.request_log_size)
        self.counters = {"http_requests": 0, "injected_errors": 0, "admission_rejections": 0}
        self._ids = itertools.count()
        self._key_digests = [hashlib.sha256(k.encode()).digest() for k in options.api_keys]
        self._tasks: list[asyncio.Task[None]] = []
        self._routes: dict[tuple[str, str], Handler] = {
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/responses"): self.responses.create,
            ("POST", "/v1/embeddings"): self._embeddings,
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
            ("GET", "/ping"): self._health,
            ("POST", "/ping"): self._health,
            ("GET", "/version"): self._version,
            ("GET", "/load"): self._load,
            ("POST", "/tokenize"): self._tokenize,
            ("GET", "/metrics"): self._metrics,
            **SimControl(self).routes(),
            **self.lora.routes(),
            **ExtraRoutes(self).routes(),  # vLLM's other client routes (extra_routes.py)
            **(DevRoutes(self).routes() if options.dev_mode else {}),
        }
        self._paths = {path for _, path in self._routes}

    # -- ASGI ------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        self.counters["http_requests"] += 1
        method, path = scope["method"], scope["path"]
        # vLLM's --api-key middleware runs before routing, on these prefixes only, never on
        # OPTIONS: an unknown path under /v1 is its 401 too, not a 404
        if (path.startswith(_KEYED) and method != "OPTIONS" and self._key_digests
                and not self._authorized(scope)):
            await send_json(send, 401, {"error": "Unauthorized"})
            return
        handler = self._routes.get((method, path)) or self.responses.route(method, path)
        if handler is None:
            status = 405 if path in self._paths else 404
            detail = "Method Not Allowed" if status == 405 else "Not Found"
            await send_json(send, status, {"detail": detail})
            return
        try:
            await handler(scope, receive, send)
        except SimError as err:
            await send_json(send, err.status, error_body(err, self.options.legacy_errors))
        except ClientGone:
            return

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._tasks = [asyncio.create_task(r.run()) for r in self.runners]
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for task in self._tasks:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _authorized(self, scope: Scope) -> bool:
        value = _header(scope, b"authorization") or ""
        if not value.startswith("Bearer "):
            return False
        digest = hashlib.sha256(value[7:].encode()).digest()
        return any(hmac.compare_digest(digest, d) for d in self._key_digests)

    async def _json_body(self, scope: Scope, receive: Receive) -> dict[str, Any]:
        raw = await read_body(receive)
        try:
            body = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError:
            body = None
        self._log_request(scope, body)
        if not isinstance(body, dict):
            raise SimError(400, "1 validation error: the body must be a JSON object",
                           "Bad Request")
        return body

    def _log_request(self, scope: Scope, body: Any) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        self.requests.append({"method": scope["method"], "path": scope["path"],
                              "headers": headers, "body": body, "time": time.time()})

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if (model and model != self.options.model and model not in self.options.aliases
                and self.lora.get(model) is None):
            # (none or "": vLLM's own model)
            raise SimError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    @property
    def num_waiting(self) -> int:
        return sum(e.num_waiting for e in self.engines)

    @property
    def num_running(self) -> int:
        return sum(e.num_running for e in self.engines)

    @property
    def in_flight(self) -> int:
        return sum(r.in_flight for r in self.runners)

    def pick_runner(self) -> EngineRunner:
        """The data-parallel engine for a new request: vLLM's DP load balancer picks the lowest
        ``waiting * 4 + running`` (vllm/v1/engine/core_client.py), the first on a tie."""
        if len(self.runners) == 1:
            return self.runners[0]
        scores = [e.num_waiting * 4 + e.num_running for e in self.engines]
        return self.runners[scores.index(min(scores))]

    def check_faults(self) -> None:
        """The engine-state faults, met when the frontend hands the request to the engine."""
        faults = self.faults
        if faults.drop_connections:
            raise ConnectionDropped("simulated dropped connection")
        if faults.dead:  # EngineDeadError (error_response.py)
            raise dead_engine_error()
        if faults.engine_faulted:
            raise engine_faulted_error()

    def _admit(self, sequences: int = 1) -> None:
        """Fault switches and the admission limit, in the order vLLM's frontend would meet them
        (a request of n sequences counts n against the limit, as vLLM's)."""
        faults = self.faults
        self.check_faults()
        if faults.should_fail():
            self.counters["injected_errors"] += 1
            if faults.error_status == 503:
                raise SimError(503, "Simulated service unavailable.", "ServiceUnavailableError")
            raise SimError(500, "Simulated internal server error.", "InternalServerError")
        limit = faults.max_num_queued_reqs
        if limit and self.num_waiting + self.num_running + sequences > limit:
            self.counters["admission_rejections"] += 1
            self.metrics.admission_rejections += 1
            raise SimError(503, BUSY, "Service Unavailable")

    # -- generation ------------------------------------------------------------------------
    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, chat=True)

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, chat=False)

    async def _generate(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        body = await self._json_body(scope, receive)
        self._check_model(body)
        if await poisoned(body, send, self.counters):  # a test's per-request fault
            return
        gen = self.parse(body, chat)
        adapter = self.lora.get(body.get("model"))
        if adapter is not None:  # its KV is its own: vLLM hashes the LoRA name into block 0
            gen.salt = f"{gen.salt or ''}\x00lora\x00{adapter}"
        rid = _header(scope, b"x-request-id") or gen.request_id or uuid.uuid4().hex
        response_id = ("chatcmpl-" if chat else "cmpl-") + rid
        fmt = _header(scope, b"endpoint-load-metrics-format")
        reply = (lambda: load_report_header(fmt, self.engines, self.options.log_stats)) if (
            fmt is not None) else None
        await self.launch(scope, receive, send, gen, rid,
                          lambda g: ChatFormat(g, response_id), reply, adapter)

    def parse(self, body: dict[str, Any], chat: bool) -> GenRequest:
        cfg = self.engine.config
        return parse_generation(body, chat, cfg.max_model_len, self.options.reasoning)

    async def launch(self, scope: Scope, receive: Receive, send: Send, gen: GenRequest, rid: str,
                     make_format: Callable[[Generation], Format],
                     reply_headers: Callable[[], list[tuple[bytes, bytes]]] | None = None,
                     adapter: str | None = None) -> Generation:
        """Admit, wait out the latency fault, then serve ``gen`` on a data-parallel engine."""
        self._admit(gen.n)
        delay = self.faults.delay_s(gen.seed)
        if delay > 0:
            await asyncio.sleep(delay)
            self.check_faults()
        headers = [(b"x-request-id", rid.encode())] if self.options.request_id_headers else []
        # an adapter's answers name the adapter (vLLM's model_name(lora_request))
        ctx = self.ctx if adapter is None else replace(self.ctx, model=adapter)
        generation = Generation(ctx, self.pick_runner(), gen, f"{rid}#{next(self._ids)}",
                                headers, reply_headers)
        if adapter is not None:
            self.lora.in_flight[adapter] += 1
        try:  # ConnectionDropped propagates: uvicorn then closes the connection
            await generation.serve(receive, send, make_format(generation))
        finally:
            if adapter is not None:
                self.lora.in_flight[adapter] -= 1
        return generation

    # -- other OpenAI / vLLM endpoints -----------------------------------------------------
    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._json_body(scope, receive)
        self._check_model(body)
        validate_cache_salt(body)
        self._admit()
        if body.get("input") is None:
            raise SimError(400, "1 validation error: 'input' is required", "Bad Request", "input")
        # vLLM's `str | list[str] | list[int] | list[list[int]]`: no deeper nesting, no mix
        prompts = [item_prompt(item, "input") for item in prompt_items(body["input"], "input")]
        full = self.options.embedding_dim
        dim = body.get("dimensions") or full
        # (no longer than the model's own vector: a client's 10**9 took the replica's memory
        # and its event loop for minutes)
        if not isinstance(dim, int) or not 1 <= dim <= full:
            raise SimError(400, f"'dimensions' must be an integer from 1 to {full}, the model's "
                           "embedding size", param="dimensions")
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise SimError(400, "1 validation error: 'encoding_format' must be 'float' or "
                           "'base64'", "Bad Request", "encoding_format")
        check_vocabulary(prompts)
        data, total = [], 0
        for i, prompt in enumerate(prompts):
            total += prompt.num_tokens
            data.append({"index": i, "object": "embedding",
                         "embedding": _encoded(_vector(prompt.seed(), dim), encoding)})
        await send_json(send, 200, {
            "id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": self.options.model, "data": data,
            "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0,
                      "prompt_tokens_details": None}})

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        now, model = int(time.time()), self.options.model
        permission = {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                      "created": now, "allow_create_engine": False, "allow_sampling": True,
                      "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                      "allow_fine_tuning": False, "organization": "*", "group": None,
                      "is_blocking": False}
        # one card per served name (vLLM's --served-model-name), each rooted at the model path
        cards = [{"id": name, "object": "model", "created": now, "owned_by": "vllm",
                  "root": self.options.root or model, "parent": None,
                  "max_model_len": self.engine.config.max_model_len, "permission": [permission]}
                 for name in (model, *self.options.aliases)]
        cards += self.lora.cards(now, permission)  # (parent: the base model's name)
        await send_json(send, 200, {"object": "list", "data": cards})

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        # only the engine's errored flag (EngineDeadError) makes /health 503; a faulted (paused)
        # engine still answers 200. /ping is the same handler (SageMaker-style, as vLLM's).
        if self.faults.health_latency_ms > 0:
            await asyncio.sleep(self.faults.health_latency_ms / 1000.0)
        status = 503 if self.faults.dead else 200
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    async def _version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"version": VLLM_VERSION})

    async def _load(self, scope: Scope, receive: Receive, send: Send) -> None:
        # counted only with --enable-server-load-tracking, else vLLM's counter stays 0
        # (vllm/entrypoints/serve/instrumentator/basic.py)
        load = self.in_flight if self.options.server_load_tracking else 0
        await send_json(send, 200, {"server_load": load})

    async def _tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._json_body(scope, receive)
        self._check_model(body)
        ids = parse_prompt(body, chat="messages" in body).ids
        await send_json(send, 200, {"count": len(ids), "max_model_len":
                                    self.engine.config.max_model_len, "tokens": ids,
                                    "token_strs": None})

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        status, page = await self.faults.metrics_answer(self.metrics.render())
        await send_bytes(send, status, page, (b"content-type", CONTENT_TYPE.encode()))


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    """vLLM's `encoding_format`: the floats, or (``base64``, the openai SDK's default) their
    little-endian float32 bytes in base64."""
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _vector(prompt_seed: int, dim: int) -> list[float]:
    """A deterministic unit vector for a prompt."""
    seed = prompt_seed & 0xFFFFFFFF
    h = xxhash.xxh32_intdigest
    raw = [h(i.to_bytes(4, "little"), seed) / 4294967296.0 - 0.5 for i in range(dim)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]
