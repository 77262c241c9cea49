"""The policy document: pools, public model names and tiers.

This is the part of the configuration operators change at runtime (`GET|PUT /admin/policy`);
it is validated as a whole so a bad document never half-applies. Errors name the field
(``models.llama-70b.premium: unknown pool 'fp9'``); `parse_policy` turns pydantic's errors
into one `PolicyValidationError(field, message)` for callers that answer with HTTP 400.
"""

from __future__ import annotations

import re
from itertools import pairwise
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)

from gateway.discovery.config import parse_discovery
from gateway.errors import NAME_CHARS, shown_name
from gateway.replica_url import url_problem
from gateway.replicas import replica_id
from gateway.urls import shown_url
from routing.flow.config import DEFAULT_MAX_WAIT_S, DEFAULT_MIN_SHARE

__all__ = [
    "DEFAULT_TIER",
    "MAX_LIMIT",
    "NAME_PATTERN",
    "NAME_RULE",
    "RESERVED_NAME",
    "RESERVED_RULE",
    "Fairness",
    "Limits",
    "LoadThreshold",
    "PolicyDoc",
    "PolicyValidationError",
    "PoolConfig",
    "TierConfig",
    "TierFlow",
    "check_names",
    "check_replicas_distinct",
    "check_spills",
    "parse_policy",
    "spill_problems",
]

DEFAULT_TIER = "default"
# Tenant ids, salt groups, pool and tier names appear in URLs, response headers
# (``x-kvgate-replica: <pool>/<replica>``), metric labels and Redis keys
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
NAME_RULE = "1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit"  # in words
# the label of a request's tenant, tier and pool before they are known (a 401, a 404): a tenant,
# tier or pool of that name had its requests counted and logged with those refusals
RESERVED_NAME = "none"
RESERVED_RULE = (f"'{RESERVED_NAME}' is reserved: it is the metric label and log value of "
                 "requests refused before their tenant, tier and pool were known")



# A limit's largest value: far past any real budget, and exact in the admission scripts'
# arithmetic (Lua numbers are doubles). Past it a limit meant nothing exact: remaining counts
# above the limit in the x-ratelimit headers, and from 10**309 (a float infinity) a 500 on
# every request of the tenant.
MAX_LIMIT = 10**12


# Every number and boolean of the documents is strict: a JSON string ("100", "true"), a
# boolean for a number (true read as 1: a tenant limited to 1 request a minute) or a float
# for an integer is refused naming the field, not converted -- pydantic's lax mode took
# `"rpm": "100"` from the admin API, so a client's quoting mistake passed unseen. (JSON
# object keys are strings: `fairness.min_share`'s band keys stay lax.)
Int = Annotated[int, Strict()]
Num = Annotated[float, Strict()]  # (an integer is a number)
Bool = Annotated[bool, Strict()]
Limit = Annotated[Int, Field(gt=0, le=MAX_LIMIT)]


class Limits(BaseModel):
    """Per-tenant limits (a tier's defaults, or a tenant's overrides). None = unlimited."""

    model_config = ConfigDict(extra="forbid")
    rpm: Limit | None = None
    tpm: Limit | None = None
    max_concurrency: Limit | None = None

    def overlay(self, overrides: Limits) -> Limits:
        """These limits with every field `overrides` sets replacing ours."""
        return self.model_copy(update=overrides.model_dump(exclude_unset=True))


class PoolConfig(BaseModel):
    """Replicas serving the same weights under one served model name."""

    model_config = ConfigDict(extra="forbid")
    served_model: str | None = None  # None: learn it from the replicas' /v1/models
    replicas: list[str] = Field(default_factory=list)
    discovery: dict[str, dict[str, object]] | None = None  # {kubernetes: {...}} | {dns: {...}}
    api_key_env: str | None = None
    priority: Bool = False  # the pool runs --scheduling-policy priority
    # flow control's in-flight bound per replica of this pool (its vLLM's --max-num-seqs),
    # over `flow.max_inflight`: policy, so changed at run time (`FlowGate.policy_changed`)
    max_inflight: Annotated[Int, Field(ge=1, le=MAX_LIMIT)] | None = None

    @field_validator("replicas", mode="before")
    @classmethod
    def _lower_scheme_and_host(cls, value: object) -> object:
        # `HTTP://Host:8000` is the same replica as `http://host:8000` (RFC 3986: both are
        # case-insensitive); refused, an operator's upper-case URL stopped the config check
        return [_lowered(u) if isinstance(u, str) else u for u in value] if isinstance(
            value, list) else value

    @model_validator(mode="after")
    def _has_replicas(self) -> PoolConfig:
        if not self.replicas and not self.discovery:
            raise ValueError("a pool needs 'replicas' or 'discovery'")
        if self.discovery:  # checked here, not first by the lifespan once the port is bound
            parse_discovery(self.discovery)  # a ValueError naming the field
        for url in self.replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(
                    f"replica URL must start with http:// or https://: {shown_url(url)!r}")
            if url.rstrip("/").endswith("/v1"):  # an OpenAI client's base URL: never ready
                raise ValueError(
                    f"a replica URL is the server's, without /v1: {shown_url(url)!r}")
            try:  # its id (`replica_id`) and the connections need host and port
                replica_id(url)
                if not urlsplit(url).hostname:  # `http://:8000` became replica `None:8000`
                    raise ValueError(url)
            except ValueError:  # (urllib's message would repeat a password read as a port)
                raise ValueError("a replica URL needs a valid host and port (a password with "
                                 f"'#', '?' or '/' percent-encoded): {shown_url(url)!r}") from None
        return self


def _lowered(url: str) -> str:
    """`url` with its scheme and host name in lower case; its user info (a password keeps
    its case) and path as written."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    cut = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0),
              default=len(rest))
    authority, tail = rest[:cut], rest[cut:]
    user, at, host = authority.rpartition("@")
    return f"{scheme.lower()}://{user}{at}{host.lower()}{tail}"


class LoadThreshold(BaseModel):
    """A per-replica load level: vLLM's waiting-queue depth and KV-cache occupancy (0..1)."""

    # finite: an infinite `waiting` (JSON bodies may say Infinity) was stored as null, and
    # the stored policy was then unreadable on every gateway
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    waiting: Annotated[Num, Field(ge=0)]
    kv_usage: Annotated[Num, Field(ge=0, le=1)]


# a tenant's weight in flow control's fair queue (relative: 1e-3 to 1e6 spans a billion). The
# floor: a request's advance in the band's virtual time is its cost / weight, so 1e-300 took it
# to infinity within a few hundred requests, and from then on every tenant of the band started
# at an infinite tag (first come, first served: the fair share gone until the gateway
# restarted); far above ordinary costs, float tags no longer tell requests apart either
Weight = Annotated[Num, Field(ge=1e-3, le=1e6)]


class TierFlow(BaseModel):
    """The tier in flow control's admission queue (used only while its pool is saturated)."""

    model_config = ConfigDict(extra="forbid")
    # priority band, lower first (None: the tier's `priority`, so the queue keeps vLLM's order)
    band: Int | None = None
    # share of its band's tokens relative to the band's other tenants (`fairness.tenants`
    # overrides it per tenant)
    weight: Weight = 1.0
    # longest wait in the queue; then 429 with Retry-After
    max_wait_s: Annotated[Num, Field(gt=0, le=3600)] = DEFAULT_MAX_WAIT_S


Share = Annotated[Num, Field(ge=0, lt=1)]


class Fairness(BaseModel):
    """Flow control's sharing rules: band floors and per-tenant weights (hot-reloaded)."""

    model_config = ConfigDict(extra="forbid")
    # band -> minimum share of the dispatched tokens while a higher band competes with it
    min_share: dict[int, Share] = Field(default_factory=dict)
    default_min_share: Share = DEFAULT_MIN_SHARE  # bands not in `min_share`
    tenants: dict[str, Weight] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _shares_fit(self) -> Fairness:
        if sum(self.min_share.values()) >= 1.0:
            raise ValueError("fairness.min_share: the shares must add up to less than 1")
        return self


# each threshold's levels when the policy leaves them out
_SPILL_WHEN: dict[str, float] = {"waiting": 8, "kv_usage": 0.95}
_BORROW_BELOW: dict[str, float] = {"waiting": 0, "kv_usage": 0.5}


class TierConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    limits: Limits = Field(default_factory=Limits)
    # vLLM `priority` for pools that run --scheduling-policy priority; within 64 bits, as
    # every integer kvgate writes into a request body (a wider one was a 500 on every request)
    priority: Annotated[Int, Field(ge=-(2**63), le=2**63 - 1)] = 0
    spill_to: str | None = None  # a pool this tier may overflow to when its own is saturated
    # A replica is saturated at or above either level; the tier spills only when every
    # replica of its own pool is saturated (or unhealthy).
    spill_when: LoadThreshold = Field(default_factory=lambda: LoadThreshold(**_SPILL_WHEN))
    # A pool this tier may borrow while its own is saturated AND that pool is idle: every
    # healthy replica at or below `borrow_below.waiting` and below `borrow_below.kv_usage`.
    borrow_from: str | None = None
    borrow_below: LoadThreshold = Field(default_factory=lambda: LoadThreshold(**_BORROW_BELOW))
    # vLLM's operator-only body fields (`request_id`, `kv_transfer_params`, `vllm_xargs`) are
    # forwarded only for tiers that allow them; otherwise they are dropped from the request
    operator_fields: Bool = False
    flow: TierFlow = Field(default_factory=TierFlow)  # flow control (gateway/flow/)

    @model_validator(mode="before")
    @classmethod
    def _partial_thresholds(cls, data: Any) -> Any:
        """A threshold that names one level keeps the other's default (the docs give each
        level's default: `spill_when: {kv_usage: 0.9}` alone was refused, `waiting` missing)."""
        if isinstance(data, dict):
            for name, default in (("spill_when", _SPILL_WHEN), ("borrow_below", _BORROW_BELOW)):
                given = data.get(name)
                if isinstance(given, dict):
                    data = {**data, name: {**default, **given}}
        return data


class PolicyDoc(BaseModel):
    """`pools`, `models`, `tiers`: validated together, versioned by the store."""

    model_config = ConfigDict(extra="forbid")
    pools: dict[str, PoolConfig] = Field(default_factory=dict)
    models: dict[str, dict[str, str]] = Field(default_factory=dict)  # public -> {tier: pool}
    # a tier's name as a tenant's tier may be (`Tenant.tier`): a longer one no tenant could use
    # (names on input: `check_names`)
    tiers: dict[Annotated[str, Field(min_length=1, max_length=64)], TierConfig] = Field(
        default_factory=lambda: {DEFAULT_TIER: TierConfig()})
    fairness: Fairness = Field(default_factory=Fairness)  # flow control's sharing rules

    @model_validator(mode="after")
    def _references_resolve(self) -> PolicyDoc:
        if not self.tiers:
            # (the default tier needs no entry beside others, but a policy of it alone names
            # it: removing the last named tier was refused without saying how)
            raise ValueError("tiers: at least one tier is required (the default tier alone: "
                             "{\"default\": {}})")
        for model, per_tier in self.models.items():
            if not model:  # a request's `model` is a non-empty string: none could name it
                raise ValueError("models: a public model name must not be empty")
            if not per_tier:
                raise ValueError(f"models.{model}: maps no tier to a pool")
            for tier, pool in per_tier.items():
                where = f"models.{model}.{tier}"
                if pool not in self.pools:
                    raise ValueError(f"{where}: unknown pool {pool!r}")
                if not self.knows_tier(tier):
                    raise ValueError(f"{where}: unknown tier {tier!r}")
        for name, tier_cfg in self.tiers.items():
            for attr in ("spill_to", "borrow_from"):
                target = getattr(tier_cfg, attr)
                if target is not None and target not in self.pools:
                    raise ValueError(f"tiers.{name}.{attr}: unknown pool {target!r}")
        return self

    def flow_class(self, tier: str, tenant: str) -> tuple[int, float, float]:
        """(band, weight, longest wait in seconds) of ``tenant`` of ``tier`` in flow control."""
        cfg = self.tiers.get(tier) or _DEFAULT_TIER_CONFIG
        flow = cfg.flow
        band = flow.band if flow.band is not None else cfg.priority
        return band, self.fairness.tenants.get(tenant, flow.weight), flow.max_wait_s

    def knows_tier(self, tier: str) -> bool:
        """A tier tenants may be in: one the policy defines, or 'default' (always there)."""
        return tier == DEFAULT_TIER or tier in self.tiers

    def pool_for(self, model: str, tier: str) -> str | None:
        """The pool serving public `model` for `tier` (falling back to the 'default' tier)."""
        per_tier = self.models.get(model)
        if per_tier is None:
            return None
        return per_tier.get(tier) or per_tier.get(DEFAULT_TIER)


_DEFAULT_TIER_CONFIG = TierConfig()


class PolicyValidationError(ValueError):
    """An invalid policy document; `field` is the dotted path of the first offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


def check_replicas_distinct(doc: PolicyDoc) -> None:
    """A replica (host:port) belongs to one pool: the gateway keys a replica's scrapes and
    health by host:port, so one listed in two pools went unscraped in one of them (its load
    stale there, with no error anywhere). Checked on input (the config file, `PUT
    /admin/policy`) only, not in the model: a stored document that predates the rule must
    still load, or a gateway would refuse to start on it."""
    owner: dict[str, str] = {}
    for name, pool in doc.pools.items():
        here: set[str] = set()
        for url in pool.replicas:
            if (problem := url_problem(url)) is not None:  # (one kvgate could not reach)
                raise PolicyValidationError(f"pools.{name}.replicas",
                                            f"{shown_url(url)!r}: {problem}")
            rid = replica_id(url)
            if rid in here:  # two replicas of one id: the router and scrapes would mix them
                raise PolicyValidationError(
                    f"pools.{name}.replicas", f"{shown_url(url)}: {rid} is listed twice")
            here.add(rid)
            first = owner.setdefault(rid, name)
            if first != name:
                raise PolicyValidationError(
                    f"pools.{name}.replicas",
                    f"{shown_url(url)} is also a replica of pool {first!r}; "
                    "a replica belongs to one pool")


def parse_policy(data: Any) -> PolicyDoc:
    """Validate a policy document (a dict from JSON/YAML) or raise `PolicyValidationError`."""
    try:
        doc = PolicyDoc.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(part) for part in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":  # as the config file's: where it belongs
            from gateway.config.explain import unknown_hint  # lazy: gateway.config imports us

            msg = "unknown field" + unknown_hint(tuple(map(str, err["loc"])), policy=True)
        if not loc and ": " in msg:  # our own messages lead with the field
            loc, msg = msg.split(": ", 1)
        raise PolicyValidationError(loc, msg) from None
    check_replicas_distinct(doc)
    check_names(doc)
    _check_model_names(doc)
    check_spills(doc)
    return doc


def check_names(doc: PolicyDoc) -> None:
    """Pools and tiers are named as tenants are (`NAME_PATTERN`): their names go into
    response headers (``x-kvgate-replica: <pool>/<replica>``), metric labels and logs. Any
    string was taken: a pool named with a CR LF left every request routed there without an
    answer (its header could not be written), a '/' made that header ambiguous, an empty
    name could be mapped but never found. On input only, as `check_replicas_distinct`."""
    for section, names in (("pools", doc.pools), ("tiers", doc.tiers)):
        for name in names:
            if re.fullmatch(NAME_PATTERN, name) is None:
                raise PolicyValidationError(
                    section, f"{shown_name(name)!r} is not a name: {NAME_RULE}")
            if name == RESERVED_NAME:
                raise PolicyValidationError(f"{section}.{name}", RESERVED_RULE)


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _check_model_names(doc: PolicyDoc) -> None:
    """A public model name is one a client's request names: no longer than the `NAME_CHARS`
    a client's name is shown whole in (a 5,000-character one was stored). On input only, as
    `check_replicas_distinct`: a stored document that predates the rule must still load."""
    for model in doc.models:
        if len(model) > NAME_CHARS:
            raise PolicyValidationError(
                "models", f"a public model name is at most {NAME_CHARS} characters "
                          f"(one of {len(model)} was sent)")
        # a CR LF or an escape sequence went whole into every error naming the models and into
        # `kvgate admin` and `GET /v1/models` output an operator reads in a terminal
        if (bad := next((c for c in model if _CONTROL.match(c)), None)) is not None:
            raise PolicyValidationError(
                "models", f"a public model name holds no control character "
                          f"({shown_name(model)!r} holds U+{ord(bad):04X})")


def check_spills(doc: PolicyDoc) -> None:
    """Spill edges (a tier's pool for a model -> its `spill_to`) form no cycle, and a
    `spill_to` is used by some model of its tier.

    At run time a request spills at most once, but a cycle (premium fp8 -> awq while free
    awq -> fp8) means free takes premium capacity whenever it is busy, which the tier rules
    forbid: free may only *borrow* an idle pool (`borrow_from`). Every edge counts: two tiers
    spilling one pool's model to different pools were one edge (the first tier's), so a
    cycle through the second passed or not by the tiers' order. A model served from the
    tier's `spill_to` pool itself has nowhere to spill (the run time keeps it home): no edge,
    and no cycle; a `spill_to` that is the tier's own pool for every model it serves would
    never spill, and is refused as that (it was called a "spill cycle", naming whichever
    model came first). On input only, as `check_replicas_distinct`: a stored document
    accepted by an earlier release still loads.
    """
    if problems := spill_problems(doc):
        raise PolicyValidationError(*problems[0])


def spill_problems(doc: PolicyDoc) -> list[tuple[str, str]]:
    """Every spill problem of `doc` as (field, message), in `check_spills`' order: each
    model's spill cycles (one per ring, as first found depth first), then each `spill_to`
    that would never spill."""
    out: dict[tuple[str, str], None] = {}
    for model in doc.models:
        edges: dict[str, dict[str, str]] = {}  # pool -> {spill pool: a tier spilling there}
        for tier_name, tier in doc.tiers.items():
            src = doc.pool_for(model, tier_name)
            if src is not None and tier.spill_to is not None and src != tier.spill_to:
                edges.setdefault(src, {}).setdefault(tier.spill_to, tier_name)
        for cycle in _cycles(edges):
            tiers = [edges[a][b] for a, b in pairwise(cycle)]
            out[(f"tiers.{tiers[-1]}.spill_to",
                 f"spill cycle for model {model!r}: {' -> '.join(cycle)} (tiers "
                 f"{', '.join(dict.fromkeys(tiers))})")] = None
    for tier_name, tier in doc.tiers.items():
        served = {m: p for m in doc.models if (p := doc.pool_for(m, tier_name)) is not None}
        if tier.spill_to is not None and served and set(served.values()) == {tier.spill_to}:
            out[(f"tiers.{tier_name}.spill_to",
                 f"{tier.spill_to!r} is the tier's own pool for every model it serves "
                 f"({', '.join(map(repr, sorted(served)))}): it would never spill; remove "
                 "spill_to or serve one of them from another pool")] = None
    return list(out)


def _cycles(edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """The simple cycles of a small spill graph as pools (the first repeated at the end),
    each once, in the order depth first from each pool in turn finds them: the report does
    not depend on chance."""
    found: dict[tuple[str, ...], list[str]] = {}  # rotated to its least pool -> as found

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            ring = path[path.index(node):]
            i = ring.index(min(ring))
            found.setdefault(tuple(ring[i:] + ring[:i]), ring)
            return
        for nxt in edges.get(node, {}):
            visit(nxt, [*path, node])

    for start in edges:
        visit(start, [])
    return [[*ring, ring[0]] for ring in found.values()]
