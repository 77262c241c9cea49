"""`kvgate epp`'s flags and start-up warnings (gateway/epp/cli.py)."""

from __future__ import annotations

import pytest

from gateway.config import KvgateConfig
from gateway.epp.cli import (
    DEFAULT_HTTP_PORT,
    build_parser,
    load,
    named_hosts,
    stall_cut_by_envoy,
)


def _cfg(*argv: str) -> KvgateConfig:
    return load(build_parser().parse_args([*argv, "--no-auth"]))


def test_defaults_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_CONFIG", "")
    cfg = _cfg("--upstream", "http://10.0.0.1:8000")
    assert (cfg.epp.port, cfg.epp.fallbacks, cfg.server.admin_port) == (9002, 0, DEFAULT_HTTP_PORT)
    cfg = _cfg("--upstream", "http://10.0.0.1:8000", "--port", "7002", "--http-port", "7090",
               "--fallbacks", "2")
    assert (cfg.epp.port, cfg.epp.fallbacks, cfg.server.admin_port) == (7002, 2, 7090)


def test_the_http_port_may_be_8000(monkeypatch: pytest.MonkeyPatch) -> None:
    """The picker binds no `server.port` (default 8000): `--http-port 8000` (or a config's
    `server.admin_port: 8000`) was refused as "admin_port must differ from port"."""
    monkeypatch.setenv("KVGATE_CONFIG", "")
    cfg = _cfg("--upstream", "http://10.0.0.1:8000", "--http-port", "8000")
    assert cfg.server.admin_port == 8000
    monkeypatch.setenv("KVGATE_SERVER__ADMIN_PORT", "8000")
    assert _cfg("--upstream", "http://10.0.0.1:8000").server.admin_port == 8000


def test_the_picker_is_one_process_whatever_server_workers_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It runs one process: a config's workers 2 halved its share of a tier's limits in a
    Redis outage and told its doctor of workers that do not exist."""
    monkeypatch.setenv("KVGATE_CONFIG", "")
    monkeypatch.setenv("KVGATE_SERVER__WORKERS", "2")
    assert _cfg("--upstream", "http://10.0.0.1:8000").server.workers == 1


@pytest.mark.parametrize(("urls", "named"), [
    (["http://10.0.0.1:8000", "http://[fd00::1]:8000"], None),
    (["http://vllm-0.llm:8000", "http://10.0.0.2:8000"], "vllm-0.llm"),
])
def test_replicas_listed_by_name_are_warned_about(
    monkeypatch: pytest.MonkeyPatch, urls: list[str], named: str | None
) -> None:
    monkeypatch.setenv("KVGATE_CONFIG", "")
    cfg = _cfg(*[a for u in urls for a in ("--upstream", u)])
    warnings = named_hosts(cfg)
    if named is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and named in warnings[0]


@pytest.mark.parametrize(("first_byte", "idle", "warned"), [
    (None, None, False),  # the defaults: 300 s above 120 s
    ("3", "3", True),  # Envoy's per-try idle timeout fires with the picker's: it may win
    ("2", "3", True),
    ("4", "2", False),
])
def test_a_first_byte_timeout_not_above_the_idle_one_is_warned_about(
    monkeypatch: pytest.MonkeyPatch, first_byte: str | None, idle: str | None, warned: bool,
) -> None:
    """Probed through Envoy with both at 3 s: a stalled stream ended in a reset (a broken
    chunked body) instead of the picker's idle-timeout error event, and nothing said why."""
    monkeypatch.setenv("KVGATE_CONFIG", "")
    for name, value in (("FIRST_BYTE", first_byte), ("IDLE", idle)):
        if value is not None:
            monkeypatch.setenv(f"KVGATE_UPSTREAM__{name}_TIMEOUT_S", value)
    warnings = stall_cut_by_envoy(_cfg("--upstream", "http://10.0.0.1:8000"))
    assert len(warnings) == int(warned)
    assert all("upstream.first_byte_timeout_s" in w for w in warnings)
