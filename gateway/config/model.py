"""`KvgateConfig`, the whole configuration: the policy document (`pools`, `models`, `tiers`,
`fairness`) with the process-level sections and the secrets read from the environment, and
the checks that span sections."""

from __future__ import annotations

import os

from pydantic import (
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.config.sections import (
    DoctorSection,
    EppSection,
    FlowSection,
    HealthConfig,
    RoutingSection,
    ServerConfig,
    SyncSection,
    TenancySection,
    TenantBootstrap,
    UpstreamConfig,
)
from gateway.config.spills import check_spills_at_start
from gateway.errors import NAME_CHARS, shown_name
from gateway.policy_doc import (
    DEFAULT_TIER,
    PolicyDoc,
    check_names,
    check_replicas_distinct,
)

__all__ = ["KvgateConfig"]

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")  # what redis-py connects to
# how deploy/examples/secrets.example.yaml's secrets begin (a value to replace, not a secret)
PLACEHOLDER = "REPLACE-"


class KvgateConfig(PolicyDoc):
    """The whole configuration. `pools`, `models`, `tiers` come from `PolicyDoc`."""

    model_config = ConfigDict(extra="forbid")
    # where it was read from, for the start-up line (`load_config` sets it): no field of the
    # file, nothing `config show` prints
    _source: str = PrivateAttr(default="defaults and KVGATE_* environment, no file")

    @property
    def source(self) -> str:
        """Where it was read from: the file (and whether KVGATE_CONFIG named it), or none."""
        return self._source

    @source.setter
    def source(self, value: str) -> None:
        self._source = value
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
                parsed = parse_url(value.get_secret_value())  # type: ignore[no-untyped-call]
            except ValueError as exc:
                # redis-py's text quotes a piece of the URL, which may be part of a password
                what = "its port" if "Port" in str(exc) else "an option in its query string"
                # a password holding '/', '#', '?' or '@' ends the URL's host part early: the
                # rest is read as a port, a path or a query
                raise ValueError(f"KVGATE_REDIS_URL is not a valid Redis URL: check {what}, "
                                 "and percent-encode '/', '#', '?', '@' and '%' in a user name "
                                 "or password (e.g. '/' as %2F) (the value is not shown: it "
                                 "may hold a password)") from None
            _database_named(value.get_secret_value(), parsed)
        return value

    @field_validator("admin_token", "salt_secret")
    @classmethod
    def _not_the_placeholder(cls, value: SecretStr | None,
                             info: ValidationInfo) -> SecretStr | None:
        # deploy/examples/secrets.example.yaml's values start with it: applied unedited, every
        # gateway ran with an admin token anyone can read in the repository
        if value is not None and value.get_secret_value().strip().startswith(PLACEHOLDER):
            variable = f"KVGATE_{(info.field_name or '').upper()}"
            raise ValueError(f"{variable} is the example's placeholder ({PLACEHOLDER}...): set a "
                             "random one, e.g. `openssl rand -hex 32`")
        return value

    @field_validator("admin_token")
    @classmethod
    def _admin_tokens(cls, value: SecretStr | None) -> SecretStr | None:
        from gateway.admin.auth import admin_tokens_from_env  # lazy: keeps FastAPI out

        if value is not None:
            admin_tokens_from_env(value.get_secret_value())  # ValueError: too short, malformed
        return value

    @model_validator(mode="after")
    def _pool_keys_not_the_placeholder(self) -> KvgateConfig:
        # the example's second Secret (vllm-api-keys) too: applied unedited, kvgate sent its
        # replicas a key anyone can read in the repository (read as `Pools` reads it)
        for name, pool in self.pools.items():
            key = os.environ.get(pool.api_key_env, "") if pool.api_key_env else ""
            if key.strip().startswith(PLACEHOLDER):
                raise ValueError(
                    f"pools.{name}.api_key_env: {pool.api_key_env} is the example's placeholder "
                    f"({PLACEHOLDER}...): set a random one, e.g. `openssl rand -hex 32`, on "
                    "kvgate and the pool's replicas (their --api-key)")
        return self

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
        check_names(self)  # pools' and tiers' names, as the admin API checks them
        # spill cycles, a spill_to never used: only what the previous release refused (a
        # file it started with must start after an upgrade; the rest is a start warning)
        check_spills_at_start(self)
        return self

    @model_validator(mode="after")
    def _model_names(self) -> KvgateConfig:
        # a client's request names it: bounded as the admin API bounds it (`PUT
        # /admin/policy`), so no name is stored that a client's would be cut short of
        for model in self.models:
            if len(model) > NAME_CHARS:
                raise ValueError(f"models.{shown_name(model)}: a public model name is at most "
                                 f"{NAME_CHARS} characters")
        return self

    def policy_doc(self) -> PolicyDoc:
        return PolicyDoc(pools=self.pools, models=self.models, tiers=self.tiers,
                         fairness=self.fairness)

    def public_models(self) -> dict[str, str]:
        """Public model name -> pool for the default tier. Without `models`, pools' served names."""
        if self.models:
            return {m: p for m in self.models if (p := self.pool_for(m, "default")) is not None}
        return {pc.served_model: name for name, pc in self.pools.items() if pc.served_model}


def _database_named(url: str, parsed: dict[str, object]) -> None:
    """A path after ``host:port`` that is not a number (``/db2``, ``/kvgate``) was taken by
    redis-py for database 0, without a word: two deployments meant for two databases shared
    one. (A number out of range is Redis's to refuse, and is named then.)"""
    from urllib.parse import unquote, urlsplit

    path = unquote(urlsplit(url).path).strip("/")
    if url.startswith(("redis://", "rediss://")) and path and "db" not in parsed:
        raise ValueError("KVGATE_REDIS_URL names its database by a path that is not a number "
                         "(redis://host:port/N, N from 0); it would be database 0 (the value "
                         "is not shown: it may hold a password)")
