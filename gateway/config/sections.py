"""The process-level sections of kvgate's configuration, one model each: ``server``,
``upstream``, ``health``, ``routing``, ``tenancy``, ``sync``, ``doctor``, ``epp``, ``flow`` and
the ``tenants`` seeded at start. Each checks its own fields; `gateway.config.model` puts them
together."""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Annotated, Any, Literal, get_args, get_origin

import pydantic.dataclasses
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.policy_doc import DEFAULT_TIER, RESERVED_NAME, RESERVED_RULE
from gateway.tenancy.models import NAME_PATTERN
from gateway.tenancy.service import TenancySettings
from routing.config import RouterConfig
from routing.flow.config import FlowConfig, Saturation
from routing.policies import REGISTRY

__all__ = [
    "DoctorSection",
    "EppSection",
    "FlowSection",
    "HealthConfig",
    "RoutingSection",
    "ServerConfig",
    "SyncSection",
    "TenancySection",
    "TenantBootstrap",
    "UpstreamConfig",
]

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

Pos = Annotated[float, Field(gt=0)]
# an origin as a browser sends it: scheme://host[:port], no path
ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[a-z0-9._~%!$&'()*+,;=:@\[\]-]+")
TOKEN = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")  # an HTTP token (RFC 9110 5.6.2)


def _leaf_types(annotation: Any) -> set[Any]:
    """The types a field's annotation is made of (`Annotated[int, ...] | None`: int, None)."""
    args = get_args(annotation)
    if not args:
        return {annotation}
    if getattr(annotation, "__metadata__", None) is not None:  # Annotated: its type only
        return _leaf_types(args[0])
    return set().union(*(_leaf_types(a) for a in args))


def no_bool_for_number(annotation: Any, value: Any) -> Any:
    """Refuse a boolean for a number, in a field or in a mapping's values or a list's items:
    pydantic's lax mode read `port: true` as port 1 and `retry_budget_min: no` as 0 -- and YAML
    reads yes/no and on/off as booleans too. (The policy sections are strict throughout:
    gateway/policy_doc.py; a number may still be a string here, which converts to what was
    meant.)"""
    leaves = _leaf_types(annotation)
    if isinstance(value, bool) and leaves & {int, float} and bool not in leaves:
        write = "the number, or null" if type(None) in leaves else "the number"
        raise ValueError("a boolean where a number goes (YAML reads true/false, yes/no and "
                         f"on/off as booleans): write {write}")
    args = get_args(annotation)
    if get_origin(annotation) is dict and isinstance(value, dict):
        for item in value.values():
            no_bool_for_number(args[1], item)
    elif get_origin(annotation) is list and isinstance(value, list):
        for item in value:
            no_bool_for_number(args[0], item)
    return value


class _NoBoolForNumber:
    """Every field of a section, a model or a pydantic dataclass, checked by
    `no_bool_for_number` (pydantic collects the validator from this base)."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        fields_ = cls.__pydantic_fields__  # type: ignore[attr-defined]
        return no_bool_for_number(fields_[info.field_name or ""].annotation, value)


class _Section(_NoBoolForNumber, BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerConfig(_Section):
    host: str = "0.0.0.0"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    max_body_bytes: Annotated[int, Field(gt=0)] = 8 * 1024 * 1024  # 8 MiB -> 413 above it
    # request bodies still arriving, all requests together: past it a body is refused with 503
    # + Retry-After (slow uploads, each up to `max_body_bytes`, held the gateway's memory
    # without bound: a tenant's limits are checked once its body is in); 0: no bound
    max_pending_body_bytes: Annotated[int, Field(ge=0)] = 256 * 1024 * 1024
    replica_header: bool = True  # x-kvgate-replica on proxied and stored responses
    route_header: bool = True  # x-kvgate-route on proxied and stored responses
    shutdown_grace_s: Annotated[float, Field(ge=0)] = 30.0  # in-flight streams may finish
    log_level: str = "info"
    log_format: Literal["json", "text"] = "json"  # one JSON object per line, or readable text
    # serve the admin API on this port only (same host), not on `port`; None: on `port`
    admin_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    # hostile clients: request line + headers above this, or more header fields -> 431;
    # headers not complete this long after the first byte, or a body not complete this long
    # after the headers -> 408 (gateway/httpguard.py)
    max_header_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024
    max_headers: Annotated[int, Field(ge=8)] = 100
    header_timeout_s: Pos = 10.0
    body_timeout_s: Pos = 60.0
    # an idle keep-alive connection is closed after this long: longer than clients keep theirs
    # (httpx and so the openai SDK 5 s, aiohttp 15 s, Go 90 s), or a client reusing one as the
    # gateway closes it gets a reset (uvicorn's 5 s default raced httpx's 5 s)
    keep_alive_timeout_s: Annotated[int, Field(ge=1, le=86_400)] = 120
    # worker processes sharing the port (each a member of the shared routing state; more
    # than 1 needs KVGATE_REDIS_URL: with the in-memory store it is refused at start)
    workers: Annotated[int, Field(ge=1, le=64)] = 1
    # CORS for browser clients (gateway/cors.py): origins answered (["*"]: any, as vLLM's
    # default; []: CORS off), the methods and request headers a preflight allows ("*": what
    # it asks for) and how long a browser may cache that answer. Never with credentials:
    # kvgate's API keys are bearer tokens, which a browser does not send on its own
    cors_allowed_origins: list[str] = Field(default_factory=lambda: ["*"])
    cors_allowed_methods: list[str] = Field(default_factory=lambda: ["*"])
    cors_allowed_headers: list[str] = Field(default_factory=lambda: ["*"])
    cors_max_age_s: Annotated[int, Field(ge=0, le=86_400)] = 600

    @field_validator("cors_allowed_origins", "cors_allowed_methods", "cors_allowed_headers",
                     mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        # an environment override may be a plain comma-separated string
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("cors_allowed_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        if "*" in value and len(value) > 1:
            raise ValueError("'*' allows every origin: list it alone, or list origins only")
        for origin in value:
            if origin != "*" and not ORIGIN.fullmatch(origin):
                raise ValueError(f"{origin!r} is not an origin: scheme://host[:port], lowercase, "
                                 "without a path or a trailing slash (as a browser sends it)")
        return value

    @field_validator("cors_allowed_methods", "cors_allowed_headers")
    @classmethod
    def _tokens(cls, value: list[str]) -> list[str]:
        for name in value:
            if name != "*" and not TOKEN.fullmatch(name):
                raise ValueError(f"{name!r} is not a method or header name")
        return value

    @field_validator("host", mode="before")
    @classmethod
    def _host(cls, value: Any) -> Any:
        # an empty KVGATE_SERVER__HOST (a template's unset value; read as YAML, blanks are
        # null) bound every interface, past --no-auth's loopback default
        if value is None or (isinstance(value, str) and not value.strip()):
            raise ValueError("empty: give an address, e.g. 0.0.0.0 (every interface) or "
                             "127.0.0.1 (this machine only), or leave it unset for the default")
        return value

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        level = value.lower()  # logging and uvicorn would fail at start, with a traceback
        if level not in LOG_LEVELS:
            raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}, not {value!r}")
        return level

    @model_validator(mode="after")
    def _distinct_ports(self) -> ServerConfig:
        if self.admin_port is not None and self.admin_port == self.port:
            raise ValueError("admin_port must differ from port")
        return self


class UpstreamConfig(_Section):
    """Timeouts and retries toward the replicas. Defaults suit LLM traffic."""

    connect_timeout_s: Pos = 3.0
    # until a stream's first SSE event, per try: then the next replica (whole answers: total)
    first_byte_timeout_s: Pos = 300.0
    idle_timeout_s: Pos = 120.0  # between chunks once the answer has started (a whole one's too)
    total_timeout_s: Pos = 1800.0  # whole exchange; long generations take minutes
    max_attempts: Annotated[int, Field(ge=1, le=10)] = 3  # first try + retries
    retry_budget_ratio: Annotated[float, Field(ge=0, le=1)] = 0.2  # retries per request
    retry_budget_min: Annotated[int, Field(ge=0)] = 10  # retries always allowed in reserve
    # per replica: exchanges with one replica at once (keep-alive connections); more wait in
    # kvgate, so a replica that stalls holds its own connections, not its pool's
    max_connections: Annotated[int, Field(gt=0)] = 1024
    # how long a request waits in kvgate for one of those connections (the replica is busy,
    # not failing: never charged to it); past it the next replica, else a 503 with Retry-After.
    # The first-byte clock starts once the request is sent
    connection_wait_s: Pos = 60.0
    # a whole answer, or one stream event, larger than this is not read on (a 502): held in
    # memory it could take the gateway down (vLLM's largest, a big embeddings batch, is less)
    max_answer_bytes: Annotated[int, Field(gt=0)] = 256 * 1024 * 1024
    # answers retried on another replica before the first byte (500: vLLM's dead engine)
    retry_statuses: list[Annotated[int, Field(ge=500, le=599)]] = [500, 502, 503, 504]


class HealthConfig(_Section):
    """Passive ejection and active `/health` polling."""

    interval_s: Pos = 2.0  # active poll period per replica
    # vLLM answers /health on the event loop that serves requests: slow when saturated
    timeout_s: Pos = 5.0
    slow_threshold: Annotated[int, Field(ge=1)] = 3  # consecutive slow probes -> eject
    failure_threshold: Annotated[int, Field(ge=1)] = 3  # consecutive failures -> eject
    eject_base_s: Pos = 1.0  # first ejection; doubles each time
    eject_max_s: Pos = 30.0
    busy_backoff_s: Pos = 0.25  # after a busy 503: no new picks for this long (doubles)
    busy_backoff_max_s: Pos = 2.0
    # requests running on a vLLM replica and its token counters (generated + prompt) frozen
    # this long: stalled, ejected until they move, its unanswered requests tried elsewhere
    # (gateway/stall.py). 0 or null: off. Keep it above the longest single prefill
    stall_after_s: Annotated[float, Field(ge=0)] | None = 60.0


@pydantic.dataclasses.dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class RoutingSection(RouterConfig, _NoBoolForNumber):
    """Every field of the routing core's `RouterConfig` (defined, defaulted and checked once,
    there; documented in routing/README.md), plus how often the gateway scrapes replicas."""

    scrape_interval_ms: Annotated[int, Field(gt=0)] = 250
    # how long one scrape may take: vLLM serves /metrics on the event loop that serves its
    # requests, late when saturated -- when its load matters most; the old bound, 4 intervals
    # (1 s), failed exactly those. One replica's scrapes never overlap (`gateway/scrape.py`)
    scrape_timeout_ms: Annotated[int, Field(gt=0)] = 5000

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in REGISTRY:
            raise ValueError(f"must be one of {', '.join(sorted(REGISTRY))}, not {value!r}")
        return value

    def router_config(self) -> RouterConfig:
        return RouterConfig(**{f.name: getattr(self, f.name) for f in fields(RouterConfig)})


class TenancySection(TenancySettings, _NoBoolForNumber):
    """Authentication, salts and the shared store's behaviour (secrets come from the env):
    tenancy's own settings (`gateway.tenancy.service.TenancySettings`) plus the gateway's."""

    auth: bool = True  # False = `kvgate serve --no-auth`: one tenant, no API keys
    salt_secret_file: str | None = None  # alternative to KVGATE_SALT_SECRET (first line)
    # `tenant` metric label: these ids, or (empty list) the first `metrics_max_tenants` seen;
    # every other tenant is "other", so the label stays bounded
    metrics_tenants: list[str] = Field(default_factory=list)
    metrics_max_tenants: Annotated[int, Field(ge=0)] = 20


class SyncSection(_Section):
    """Shared routing state between gateway processes over Redis (gateway/fleet/): on
    whenever KVGATE_REDIS_URL is set, unless ``enabled: false``."""

    enabled: bool = True
    flush_interval_ms: Annotated[float, Field(gt=0, le=1000)] = 20.0  # batch and read period
    heartbeat_s: Pos = 0.5  # a quiet gateway still says it is alive (and its load)
    stale_after_s: Pos = 2.0  # a peer not heard from this long ages out with its load
    stream_maxlen: Annotated[int, Field(ge=100)] = 20_000  # entries kept (approximate)
    stream_max_mb: Annotated[int, Field(ge=1)] = 64  # and at most this much of Redis's memory
    catchup_entries: Annotated[int, Field(ge=0)] = 5_000  # routes read at start (warm start)
    max_entries_per_tick: Annotated[int, Field(ge=1)] = 256  # applied per event-loop turn
    timeout_s: Pos = 1.0  # per Redis call; then degraded
    # in a burst, hold a contested pick rank x the hold window (docs/shared-state.md,
    # "Deferred picks"); off: the gateways take turns instead (as under flow control)
    hold_picks: bool = True
    # how late a peer's contested pick is applied here at most: such routes are published
    # and, while a pick is held, read at once (never more than the sync window)
    hold_window_ms: Annotated[float, Field(gt=0, le=1000)] = 20.0

    @model_validator(mode="after")
    def _stale_after_heartbeats(self) -> SyncSection:
        if self.stale_after_s < 2 * self.heartbeat_s:
            raise ValueError("stale_after_s must be at least 2 x heartbeat_s")
        return self


class DoctorSection(_Section):
    """`kvgate doctor`'s rolling history in the gateway process (gateway/doctor/)."""

    interval_s: Annotated[float, Field(ge=0.05, le=60)] = 1.0  # one snapshot per interval
    history_s: Annotated[float, Field(ge=10, le=86_400)] = 900.0  # the longest window
    # overrides of the threshold table by name (docs/doctor.md)
    thresholds: dict[str, float] = Field(default_factory=dict)

    @field_validator("thresholds")
    @classmethod
    def _known(cls, value: dict[str, float]) -> dict[str, float]:
        from gateway.doctor.thresholds import Thresholds

        Thresholds(value)  # ValueError naming the unknown threshold
        return value


class TenantBootstrap(_Section):
    # the store's own rules for these names (gateway.tenancy.models.Tenant), checked here so a
    # bad id is refused with its field's name at load, not by the seeding in the lifespan
    id: Annotated[str, Field(pattern=NAME_PATTERN)]
    tier: str = DEFAULT_TIER
    salt_group: Annotated[str, Field(pattern=NAME_PATTERN)] | None = None

    @field_validator("id", "salt_group")
    @classmethod
    def _not_reserved(cls, value: str | None) -> str | None:
        # as the admin API refuses them (`gateway.admin.schemas.TenantCreate`): a tenant named
        # `none` had its requests counted with every request refused before its tenant was
        # known; a salt group named `none` is one the CLI cannot set (`--salt-group none` is
        # "no group")
        if value == RESERVED_NAME:
            raise ValueError(RESERVED_RULE)
        return value


class EppSection(_Section):
    """`kvgate epp`: kvgate as the endpoint picker of an Envoy-based gateway (gateway/epp/).
    The HTTP port (`server.admin_port`, default 9090 there) serves /metrics, /readyz and the
    admin API; the requests themselves come through Envoy's ext_proc stream on `port`."""

    port: Annotated[int, Field(ge=0, le=65535)] = 9002  # gRPC: ext_proc and health
    # endpoints after the first in x-gateway-destination-endpoint, tried in order by a data
    # plane that takes a list (Envoy's override_host policy); an ORIGINAL_DST cluster takes
    # exactly one, so the default is none
    fallbacks: Annotated[int, Field(ge=0, le=9)] = 0


_FLOW = FlowConfig()  # flow control's core owns its defaults (why: docs/flow-control.md)


class FlowSection(_Section):
    """Flow control (gateway/flow/): an admission queue per pool while the pool is
    saturated. Bands, weights and longest waits are policy (`tiers.*.flow`, `fairness`)."""

    enabled: bool = False  # off: every request is forwarded at once, as before
    # a replica is full (would queue inside vLLM beyond the bound) at or above any of these;
    # a pool is saturated when every healthy replica is full (fleet-wide with shared state)
    max_prefill_tokens: Annotated[int, Field(ge=1)] = _FLOW.saturation.max_prefill_tokens
    max_unanswered: Annotated[int, Field(ge=1)] | None = _FLOW.saturation.max_unanswered
    max_waiting: Annotated[float, Field(ge=0)] = _FLOW.saturation.max_waiting
    kv_knee: Annotated[float, Field(gt=0, le=1)] = _FLOW.saturation.kv_knee
    max_inflight: Annotated[int, Field(ge=1)] | None = _FLOW.saturation.max_inflight
    max_queue: Annotated[int, Field(ge=0)] = _FLOW.max_queue  # per pool; 0: shed, never hold
    expected_output_tokens: Annotated[int, Field(ge=0)] = _FLOW.expected_output_tokens
    tick_ms: Annotated[float, Field(gt=0, le=1000)] = 5.0  # re-check period while queued
    # the router picks only among replicas with room, and among those the ones whose KV
    # stays under the knee with the prompt in (false: any healthy replica)
    room_only: bool = True
    # a tenant holding more than share_cap times its weighted fair share of the pool's
    # in-flight tokens is passed over by its band's other tenants; over it also in the tokens
    # sent lately (rate_window_s: a hog), it goes only to a replica with spare room (the
    # saturation bounds scaled by 1 - share_headroom, with its request in) and waits while
    # there is none (share_headroom 0: no such wait); null: no such cap
    share_cap: Annotated[float, Field(ge=1)] | None = _FLOW.share_cap
    share_headroom: Annotated[float, Field(ge=0, lt=1)] = _FLOW.share_headroom
    # with other gateways (shared state): how late their sends reach this one; within it a
    # request sent here counts once more per other gateway, for what they may have sent
    # unseen (a burst split over N gateways fills the bounds, not N times them). null: the
    # shared state's own lag (a flush interval plus the 99th percentile of its apply lag, at
    # least its sync window: `gateway/flow/peer_lag.py`)
    peer_lag_ms: Annotated[float, Field(gt=0, le=5000)] | None = None

    def flow_config(self) -> FlowConfig:
        return FlowConfig(
            saturation=Saturation(
                max_prefill_tokens=self.max_prefill_tokens,
                max_unanswered=self.max_unanswered, max_waiting=self.max_waiting,
                kv_knee=self.kv_knee, max_inflight=self.max_inflight),
            max_queue=self.max_queue, expected_output_tokens=self.expected_output_tokens,
            share_cap=self.share_cap, share_headroom=self.share_headroom,
        )
