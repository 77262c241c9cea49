"""kvgate's configuration: one typed model, loaded from YAML, then environment, then CLI.

Precedence (lowest first): defaults < file (``--config`` / ``KVGATE_CONFIG``) <
``KVGATE_<SECTION>__<KEY>`` environment overrides < command-line flags. Every error names the
field (``upstream.connect_timeout_s: ...``). The ``pools``/``models``/``tiers`` part is the
tenancy work's `PolicyDoc`; this model extends it with the process-level sections.

- `sections`: the process-level sections (``server``, ``upstream``, ``sync``, ...);
- `model`: `KvgateConfig`, the whole configuration, and its checks across sections;
- `env`: the ``KVGATE_*`` overrides and secrets, and the warning for stray variables;
- `load`: `load_config`, the file, environment and flags merged and validated;
- `explain`: a validation error as lines naming the field;
- `salt`: the salt secret and whether authentication has one;
- `report`: the redacted effective config, discovery that cannot work here;
- `selfloop`: replicas listed at the gateway's own listening address.

The rest of the tree imports from this package, not from its modules.
"""

from gateway.config.env import env_overrides, quick_unread_env, unknown_env
from gateway.config.load import NO_POOLS, NOT_JUDGED, QUICK_SOURCE, file_problems, load_config
from gateway.config.model import KvgateConfig
from gateway.config.report import discovery_problems, redacted_dump
from gateway.config.salt import MIN_SECRET_CHARS, auth_secret, salt_secret
from gateway.config.sections import (
    LOG_LEVELS,
    FlowSection,
    HealthConfig,
    ServerConfig,
    UpstreamConfig,
)
from gateway.config.selfloop import epp_ports, own_address_replicas, serve_ports
from gateway.tenancy.models import NAME_RULE

__all__ = [
    "LOG_LEVELS",
    "MIN_SECRET_CHARS",
    "NAME_RULE",
    "NOT_JUDGED",
    "NO_POOLS",
    "QUICK_SOURCE",
    "FlowSection",
    "HealthConfig",
    "KvgateConfig",
    "ServerConfig",
    "UpstreamConfig",
    "auth_secret",
    "discovery_problems",
    "env_overrides",
    "epp_ports",
    "file_problems",
    "load_config",
    "own_address_replicas",
    "quick_unread_env",
    "redacted_dump",
    "salt_secret",
    "serve_ports",
    "unknown_env",
]
