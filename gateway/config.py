"""kvgate's configuration: one typed model, loaded from YAML, then environment, then CLI.

Precedence (lowest first): defaults < file (``--config`` / ``KVGATE_CONFIG``) <
``KVGATE_<SECTION>__<KEY>`` environment overrides < command-line flags. Every error names the
field (``upstream.connect_timeout_s: ...``). The ``pools``/``models``/``tiers`` part is the
tenancy work's `PolicyDoc`; this model extends it with the process-level sections.
"""

from __future__ import annotations

import difflib
import os
import re
import secrets
import types
import typing
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic.dataclasses
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from gateway.errors import ConfigError
from gateway.policy_doc import DEFAULT_TIER, PolicyDoc, check_replicas_distinct
from gateway.tenancy.models import NAME_PATTERN
from gateway.tenancy.service import TenancySettings
from gateway.urls import shown_url
from gateway.yamlerror import not_utf8, one_line
from routing.config import RouterConfig
from routing.flow.config import FlowConfig, Saturation
from routing.policies import REGISTRY

__all__ = [
    "NO_POOLS",
    "DoctorSection",
    "FlowSection",
    "HealthConfig",
    "KvgateConfig",
    "RoutingSection",
    "ServerConfig",
    "TenancySection",
    "TenantBootstrap",
    "UpstreamConfig",
    "auth_secret",
    "discovery_problems",
    "load_config",
    "redacted_dump",
    "salt_secret",
    "unknown_env",
]

NO_POOLS = "pools: at least one pool is required"
MIN_SECRET_CHARS = 16  # the salt derivation's minimum key length (gateway.tenancy.salts)

ENV_PREFIX = "KVGATE_"
# Environment variables with a meaning of their own (not section overrides).
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")  # what redis-py connects to
ENV_SECRETS = {"KVGATE_REDIS_URL": "redis_url", "KVGATE_ADMIN_TOKEN": "admin_token",
               "KVGATE_SALT_SECRET": "salt_secret"}
# every other KVGATE_ variable something reads (no section override): the config file, and
# scripts/setup, the test suite's log and loadtest/granian_app.py's benchmark settings
ENV_OTHERS = frozenset({"KVGATE_CONFIG", "KVGATE_EXTRAS", "KVGATE_SKIP_REDIS",
                        "KVGATE_TEST_LOG", "KVGATE_BENCH_UPSTREAMS", "KVGATE_BENCH_MODEL"})

# a variable's value is read as YAML: how to write what a field of these types takes
ENV_SHAPES = {"list_type": ", a list: write it as YAML, e.g. '[a, b]'",
              "dict_type": ", a mapping: write it as YAML, e.g. '{a: 1}'"}

Pos = Annotated[float, Field(gt=0)]
# an origin as a browser sends it: scheme://host[:port], no path
ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[a-z0-9._~%!$&'()*+,;=:@\[\]-]+")
TOKEN = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")  # an HTTP token (RFC 9110 5.6.2)


class _Section(BaseModel):
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
    max_connections: Annotated[int, Field(gt=0)] = 1024  # per pool, keep-alive pooled
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


@pydantic.dataclasses.dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class RoutingSection(RouterConfig):
    """Every field of the routing core's `RouterConfig` (defined, defaulted and checked once,
    there; documented in routing/README.md), plus how often the gateway scrapes replicas."""

    scrape_interval_ms: Annotated[int, Field(gt=0)] = 250

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in REGISTRY:
            raise ValueError(f"must be one of {', '.join(sorted(REGISTRY))}, not {value!r}")
        return value

    def router_config(self) -> RouterConfig:
        return RouterConfig(**{f.name: getattr(self, f.name) for f in fields(RouterConfig)})


class TenancySection(TenancySettings):
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

    def flow_config(self) -> FlowConfig:
        return FlowConfig(
            saturation=Saturation(
                max_prefill_tokens=self.max_prefill_tokens,
                max_unanswered=self.max_unanswered, max_waiting=self.max_waiting,
                kv_knee=self.kv_knee, max_inflight=self.max_inflight),
            max_queue=self.max_queue, expected_output_tokens=self.expected_output_tokens,
            share_cap=self.share_cap, share_headroom=self.share_headroom,
        )


class KvgateConfig(PolicyDoc):
    """The whole configuration. `pools`, `models`, `tiers` come from `PolicyDoc`."""

    model_config = ConfigDict(extra="forbid")
    server: ServerConfig = Field(default_factory=ServerConfig)
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    routing: RoutingSection = Field(default_factory=RoutingSection)
    epp: EppSection = Field(default_factory=EppSection)
    tenants: list[TenantBootstrap] = Field(default_factory=list)
    tenancy: TenancySection = Field(default_factory=TenancySection)
    sync: SyncSection = Field(default_factory=SyncSection)
    doctor: DoctorSection = Field(default_factory=DoctorSection)
    flow: FlowSection = Field(default_factory=FlowSection)
    # from the environment only (KVGATE_REDIS_URL, ...); never printed
    redis_url: SecretStr | None = None
    admin_token: SecretStr | None = None
    salt_secret: SecretStr | None = None

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: SecretStr | None) -> SecretStr | None:
        # redis-py would only fail at start-up, deep in the lifespan; the URL may hold a
        # password, so the message never repeats it
        if value is not None and not value.get_secret_value().startswith(REDIS_SCHEMES):
            raise ValueError("KVGATE_REDIS_URL must start with " + ", ".join(REDIS_SCHEMES))
        if value is not None:
            from redis.connection import parse_url  # lazy: only with a Redis URL

            try:  # a bad port or option otherwise failed in the lifespan, the variable unnamed
                parse_url(value.get_secret_value())  # type: ignore[no-untyped-call]
            except ValueError as exc:
                # redis-py's text quotes a piece of the URL, which may be part of a password
                what = "its port" if "Port" in str(exc) else "an option in its query string"
                raise ValueError(f"KVGATE_REDIS_URL is not a valid Redis URL: check {what} "
                                 "(the value is not shown: it may hold a password)") from None
        return value

    @field_validator("admin_token")
    @classmethod
    def _admin_tokens(cls, value: SecretStr | None) -> SecretStr | None:
        from gateway.admin.auth import admin_tokens_from_env  # lazy: keeps FastAPI out

        if value is not None:
            admin_tokens_from_env(value.get_secret_value())  # ValueError: too short, malformed
        return value

    @model_validator(mode="after")
    def _known_tenants(self) -> KvgateConfig:
        # the admin API refuses an unknown tier (400) and a second tenant of one id (409); the
        # seeding would take either silently: a tenant never admitted (403), or one entry lost
        seen: set[str] = set()
        for i, t in enumerate(self.tenants):
            if t.tier != DEFAULT_TIER and t.tier not in self.tiers:
                known = ", ".join(sorted({DEFAULT_TIER, *self.tiers}))
                raise ValueError(f"tenants.{i}.tier: unknown tier {t.tier!r} (known: {known})")
            if t.id in seen:
                raise ValueError(f"tenants.{i}.id: tenant {t.id!r} is listed twice")
            seen.add(t.id)
        return self

    @model_validator(mode="after")
    def _replicas_distinct(self) -> KvgateConfig:
        check_replicas_distinct(self)  # PolicyValidationError is a ValueError: named field
        return self

    def policy_doc(self) -> PolicyDoc:
        return PolicyDoc(pools=self.pools, models=self.models, tiers=self.tiers,
                         fairness=self.fairness)

    def public_models(self) -> dict[str, str]:
        """Public model name -> pool for the default tier. Without `models`, pools' served names."""
        if self.models:
            return {m: p for m in self.models if (p := self.pool_for(m, "default")) is not None}
        return {pc.served_model: name for name, pc in self.pools.items() if pc.served_model}


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for key in path[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            child = {}
            node[key] = child
        node = child
    node[path[-1]] = value


def _env_path(name: str) -> list[str]:
    return [p.lower() for p in name[len(ENV_PREFIX):].split("__") if p]


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``KVGATE_SERVER__PORT=9000`` -> {"server": {"port": 9000}} (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for name, raw in environ.items():
        if name in ENV_SECRETS:
            if raw:  # an empty variable means "not set"
                out[ENV_SECRETS[name]] = raw
        elif name.startswith(ENV_PREFIX) and "__" in name:
            try:
                value = yaml.safe_load(raw) if raw else raw
            except yaml.YAMLError:
                value = raw
            _set_path(out, _env_path(name), value)
    return out


def unknown_env(cfg: KvgateConfig, environ: Mapping[str, str] | None = None) -> list[str]:
    """A warning naming each ``KVGATE_*`` variable that is not a setting (e.g. a single
    underscore: ``KVGATE_SERVER_PORT``; an unknown ``__`` field is an error already). Not
    "ignored": something else may read it (a pool's `api_key_env` known only to the stored
    policy, `kvgate admin --token-env`)."""
    env = os.environ if environ is None else environ
    known = ENV_OTHERS | ENV_SECRETS.keys() | {p.api_key_env for p in cfg.pools.values()}
    stray = sorted(name for name in env if name.startswith(ENV_PREFIX)
                   and "__" not in name and name not in known)
    if not stray:
        return []
    return [f"kvgate: warning: {', '.join(stray)}: not a kvgate setting (if meant as one, "
            "check the spelling: section and field are joined by two underscores, as in "
            "KVGATE_SERVER__PORT)"]


def deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)  # a YAML error then names the file, line and column
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:  # e.g. saved as UTF-16, or not the YAML file at all
        raise ConfigError(f"config file {path}: {not_utf8(exc)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: invalid YAML: {one_line(exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    return data


def _explain(exc: ValidationError, where: str, env_names: Mapping[tuple[str, ...], str]) -> str:
    """One line per error, naming the field (and the variable it came from, if any)."""
    lines = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):  # model, dataclass
            msg = "unknown field" + _did_you_mean(loc)
        source = next((v for path, v in env_names.items() if loc[:len(path)] == path), None)
        if source is not None:
            msg += f" (from {source}{ENV_SHAPES.get(err['type'], '')})"
        # a whole-document check (an unknown pool) names its fields in the message itself
        lines.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    return f"invalid configuration{where}:\n  " + "\n  ".join(lines)


def _did_you_mean(loc: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(loc[-1], _field_names(loc[:-1]), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _field_names(loc: tuple[str, ...]) -> list[str]:
    """The field names of the model at `loc` in the configuration ([] when not a model)."""
    kind: Any = KvgateConfig
    for part in loc:
        model_fields = getattr(kind, "__pydantic_fields__", None)
        if model_fields is not None:
            if part not in model_fields:
                return []
            kind = model_fields[part].annotation
        elif typing.get_origin(kind) in (dict, list):
            kind = typing.get_args(kind)[-1]  # a pool's or a list item's model
        else:
            return []
        kind = _unwrap(kind)
    return list(getattr(kind, "__pydantic_fields__", {}))


def _unwrap(kind: Any) -> Any:
    """`X | None` and `Annotated[X, ...]` -> X."""
    while True:
        origin = typing.get_origin(kind)
        if origin is Annotated:
            kind = typing.get_args(kind)[0]
        elif origin in (typing.Union, types.UnionType):
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        else:
            return kind


def load_config(
    path: str | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    quick: bool = False,
) -> KvgateConfig:
    """Build the effective config; raises `ConfigError` naming the offending field.

    `path=None` falls back to ``KVGATE_CONFIG``; ``""`` means no file. `quick` (the
    ``--upstream`` form) ignores file and environment pools/models: the flags define them.
    """
    env = os.environ if environ is None else environ
    if path is None:
        path = env.get("KVGATE_CONFIG") or None
    raw = _read_file(path) if path else {}
    raw = deep_merge(raw, env_overrides(env))
    if quick:
        raw.pop("pools", None)
        raw.pop("models", None)
    raw = deep_merge(raw, overrides or {})
    env_names = {tuple(_env_path(name)): name for name in env
                 if name.startswith(ENV_PREFIX) and "__" in name}
    try:
        cfg = KvgateConfig.model_validate(raw)
    except ValidationError as exc:
        where = f" in {path} (or its KVGATE_* overrides)" if path else ""
        raise ConfigError(_explain(exc, where, env_names)) from None
    if not cfg.pools:
        raise ConfigError(f"{NO_POOLS} in {path} (or use --upstream URL)" if path else
                          f"{NO_POOLS}: no configuration file given (--config FILE, or set "
                          "KVGATE_CONFIG), or use --upstream URL")
    try:
        cfg.routing.router_config()
    except ValueError as exc:  # the routing core's own checks name the field
        raise ConfigError(f"invalid configuration:\n  {exc}") from None
    return cfg


def salt_secret(cfg: KvgateConfig) -> str | None:
    """The server secret for cache salts: ``KVGATE_SALT_SECRET`` or `tenancy.salt_secret_file`.
    Both set must agree: the variable won silently, so a rotated (or unreadable) file was
    ignored while the old secret stayed in use."""
    env = cfg.salt_secret.get_secret_value() if cfg.salt_secret is not None else None
    path = cfg.tenancy.salt_secret_file
    if not path:
        return env
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"tenancy.salt_secret_file: cannot read it ({exc.strerror})") from None
    secret = lines[0].strip() if lines and lines[0].strip() else None
    if env is not None and secret != env:
        raise ConfigError("tenancy.salt_secret_file: KVGATE_SALT_SECRET is set too and differs "
                          "from the file's first line: keep one of the two")
    return secret if env is None else env


def auth_secret(cfg: KvgateConfig) -> tuple[str, bool]:
    """(salt secret, salts on?) for this config; `ConfigError` when auth lacks a secret.

    With `tenancy.auth` (the default) a secret is required. Without auth (`--no-auth`) a
    configured secret still salts the one tenant's requests; without one, a random secret
    keeps the machinery uniform and no `cache_salt` is sent (one tenant: nothing to isolate).
    """
    secret = salt_secret(cfg)
    if secret is not None and len(secret.encode()) < MIN_SECRET_CHARS:
        raise ConfigError(
            f"salt_secret: KVGATE_SALT_SECRET must be at least {MIN_SECRET_CHARS} bytes"
        )
    if secret is not None:
        return secret, True
    if cfg.tenancy.auth:
        raise ConfigError(
            "authentication is on but no salt secret is configured: set KVGATE_SALT_SECRET "
            f"(at least {MIN_SECRET_CHARS} random bytes) or tenancy.salt_secret_file, or run "
            "`kvgate serve --no-auth` for local single-tenant use"
        )
    return secrets.token_urlsafe(32), False


def discovery_problems(cfg: KvgateConfig, environ: Mapping[str, str] | None = None) -> list[str]:
    """Pools following Kubernetes without `api_server` where no in-cluster address is set
    (outside a cluster): `kvgate serve` refuses to start, rather than stop in its lifespan."""
    from gateway.discovery.config import KubernetesConfig  # lazy: only with discovery
    from gateway.discovery.kubernetes import api_server_url

    env = os.environ if environ is None else environ
    out = []
    for name, pool in cfg.pools.items():
        kube = (pool.discovery or {}).get("kubernetes")
        if kube is None:
            continue
        try:
            api_server_url(KubernetesConfig.model_validate(kube), env)
        except ValueError as exc:
            out.append(f"pools.{name}.{exc} (outside a cluster, set it: e.g. "
                       "http://127.0.0.1:8001 with `kubectl proxy`)")
    return out


def redacted_dump(cfg: KvgateConfig) -> dict[str, Any]:
    """The effective config as plain data, with secrets replaced by a marker."""
    data = cfg.model_dump(mode="json", exclude={"redis_url", "admin_token", "salt_secret"})
    for name in ("redis_url", "admin_token", "salt_secret"):
        data[name] = "<set, redacted>" if getattr(cfg, name) is not None else None
    for pool in data.get("pools", {}).values():
        pool["replicas"] = [shown_url(url) for url in pool.get("replicas") or []]
        env_name = pool.get("api_key_env")
        if env_name:
            pool["api_key"] = "<set, redacted>" if os.environ.get(env_name) else "<not set>"
    return data
