"""Configuration: file < environment < flags; errors name the field; secrets never print."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from gateway.cli.serve import (
    NO_ADMIN_WARNING,
    build_parser,
    config_from_args,
    listening,
    start_warnings,
)
from gateway.config import (
    KvgateConfig,
    discovery_problems,
    env_overrides,
    load_config,
    redacted_dump,
    unknown_env,
)
from gateway.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "kvgate.yaml"
POOLS = {"pools": {"a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}}}


def test_example_file_is_valid() -> None:
    cfg = load_config(str(EXAMPLE), environ={})
    assert set(cfg.pools) == {"fp8", "awq"}
    assert cfg.public_models() == {"llama-70b": "fp8"}
    assert cfg.policy_doc().pool_for("llama-70b", "free") == "awq"


def test_defaults_are_documented_values() -> None:
    cfg = load_config(None, overrides=POOLS, environ={})
    assert cfg.server.max_body_bytes == 8 * 1024 * 1024
    assert (cfg.upstream.connect_timeout_s, cfg.upstream.idle_timeout_s) == (3.0, 120.0)
    assert cfg.routing.policy == "cache_aware"


def test_env_overrides_file_and_flags_override_env(tmp_path: Path) -> None:
    path = tmp_path / "k.yaml"
    path.write_text(yaml.safe_dump({**POOLS, "server": {"port": 1000}}))
    env = {"KVGATE_SERVER__PORT": "2000", "KVGATE_UPSTREAM__MAX_ATTEMPTS": "2"}
    cfg = load_config(str(path), environ=env)
    assert (cfg.server.port, cfg.upstream.max_attempts) == (2000, 2)
    cfg = load_config(str(path), environ=env, overrides={"server": {"port": 3000}})
    assert cfg.server.port == 3000


def test_kvgate_config_env_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "k.yaml"
    path.write_text(yaml.safe_dump(POOLS))
    assert set(load_config(None, environ={"KVGATE_CONFIG": str(path)}).pools) == {"a"}


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"server": {"port": "http"}}, "server.port"),
        ({"upstream": {"connect_timeout_s": 0}}, "upstream.connect_timeout_s"),
        ({"routing": {"policy": "magic"}}, "routing.policy"),
        ({"routing": {"block_chars": 6}}, "routing.block_chars"),
        ({"serverr": {}}, "serverr"),
        ({"server": {"log_level": "loud"}}, "server.log_level"),
        ({"models": {"x": {"default": "nope"}}}, "models.x.default"),
        ({"pools": {"a": {"replicas": ["ftp://x"]}}}, "pools.a"),
        ({"pools": {"a": {"replicas": ["http://vllm-0:8000/v1"]}}}, "without /v1"),
        ({"pools": {"a": {"replicas": ["http://vllm-0:8000/v1/"]}}}, "without /v1"),
    ],
)
def test_errors_name_the_field(raw: dict[str, object], field: str) -> None:
    base = {**POOLS, **raw}
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides=base, environ={})
    assert field in info.value.message


@pytest.mark.parametrize(("text", "where"), [
    (b"server:\n  port: 1\n pools: [\n", "at line 3, column 2 (while parsing a block mapping"),
    (b"a: b: c\n", "mapping values are not allowed here at line 1, column 5"),
    (b'a: "x\n', "at line 2, column 1 (while scanning a quoted scalar at line 1, column 4)"),
])
def test_invalid_yaml_is_one_line_with_its_place(tmp_path: Path, text: bytes, where: str) -> None:
    path = tmp_path / "k.yaml"
    path.write_bytes(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path), environ={})
    assert err.value.message.startswith(f"config file {path}: invalid YAML: ")
    assert where in err.value.message and "\n" not in err.value.message


@pytest.mark.parametrize("text", ["pools: {}\n".encode("utf-16"), b"\x89PNG\r\n\x1a\n\x00"])
def test_a_file_not_in_utf8_is_a_config_error(tmp_path: Path, text: bytes) -> None:
    """A UTF-16 save or the wrong file: one line, not a UnicodeDecodeError's traceback."""
    path = tmp_path / "k.yaml"
    path.write_bytes(text)
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0x[0-9a-f]{2} at offset \d+\)"):
        load_config(str(path), environ={})


@pytest.mark.parametrize(("discovery", "message"), [
    ({"dns": {"nme": "vllm"}}, "pools.a: discovery.dns.nme: unknown field (did you mean name?)"),
    ({"kubernetes": {"service": "v", "scheme": "grpc"}}, "pools.a: discovery.kubernetes.scheme:"),
    ({"consul": {"name": "v"}}, "pools.a: discovery: unknown mode 'consul'"),
])
def test_a_bad_discovery_block_is_refused_at_load(discovery: dict[str, object],
                                                  message: str) -> None:
    """`kvgate config check` passed it; `kvgate serve` bound its port, then its lifespan
    failed (uvicorn's log line and exit status 3)."""
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides={"pools": {"a": {"discovery": discovery}}}, environ={})
    assert message in err.value.message


@pytest.mark.parametrize(("kube", "environ", "refused"), [
    ({"service": "v"}, {}, True),
    ({"service": "v"}, {"KUBERNETES_SERVICE_HOST": "10.0.0.1",
                        "KUBERNETES_SERVICE_PORT": "443"}, False),
    ({"service": "v", "api_server": "http://127.0.0.1:8001"}, {}, False),
])
def test_kubernetes_discovery_without_an_api_server_is_named(
    kube: dict[str, object], environ: dict[str, str], refused: bool
) -> None:
    cfg = load_config(None, overrides={"pools": {"a": {"discovery": {"kubernetes": kube}}}},
                      environ={})
    problems = discovery_problems(cfg, environ)
    assert problems == ([
        "pools.a.discovery.kubernetes.api_server: not set and KUBERNETES_SERVICE_HOST/PORT "
        "absent (outside a cluster, set it: e.g. http://127.0.0.1:8001 with `kubectl proxy`)"]
        if refused else [])


def test_no_pools_is_an_error() -> None:
    with pytest.raises(ConfigError, match="pools"):
        load_config(None, environ={})


def test_env_override_parsing() -> None:
    env = {"KVGATE_SERVER__ROUTE_HEADER": "false", "KVGATE_POOLS__X__REPLICAS": "[http://a:1]",
           "KVGATE_CONFIG": "ignored", "OTHER": "1", "KVGATE_ADMIN_TOKEN": "tok"}
    assert env_overrides(env) == {
        "server": {"route_header": False}, "pools": {"x": {"replicas": ["http://a:1"]}},
        "admin_token": "tok",
    }


def test_secrets_are_redacted() -> None:
    env = {"KVGATE_ADMIN_TOKEN": "s3cret-admin-token-0123", "KVGATE_SALT_SECRET": "pepper"}
    dumped = yaml.safe_dump(redacted_dump(load_config(None, overrides=POOLS, environ=env)))
    assert "s3cret" not in dumped and "pepper" not in dumped
    assert "redacted" in dumped


def test_quick_form_ignores_file_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_CONFIG", str(EXAMPLE))
    args = build_parser().parse_args(
        ["--upstream", "http://127.0.0.1:9001", "--port", "0", "--policy", "round_robin"])
    cfg = config_from_args(args)
    assert list(cfg.pools) == ["default"] and cfg.models == {}
    assert cfg.pools["default"].served_model is None
    assert (cfg.server.port, cfg.routing.policy) == (0, "round_robin")


def test_config_and_upstream_together_is_an_error() -> None:
    args = build_parser().parse_args(["--config", str(EXAMPLE), "--upstream", "http://a:1"])
    with pytest.raises(ConfigError):
        config_from_args(args)


def test_example_file_lists_every_section_field() -> None:
    # each setting is defined once (routing: RouterConfig; tenancy: TenancySettings + the
    # gateway's); the reference example must show every one, set or commented out
    text = EXAMPLE.read_text()
    sections = {name: field.annotation for name, field in KvgateConfig.model_fields.items()
                if name in ("server", "upstream", "health", "routing", "tenancy", "sync",
                            "doctor", "epp")}
    missing = []
    for section, model in sections.items():
        block = text.split(f"\n{section}:", 1)[1].split("\n\n", 1)[0]
        if isinstance(model, type) and issubclass(model, BaseModel):
            names: list[str] = list(model.model_fields)
        else:  # RoutingSection: a dataclass
            assert dataclasses.is_dataclass(model), (section, model)
            names = [f.name for f in dataclasses.fields(model)]
        missing += [f"{section}.{n}" for n in names
                    if f"  {n}:" not in block and f"# {n}:" not in block]
    assert missing == []


def test_example_file_shows_the_code_defaults() -> None:
    """Every value the reference example sets in a section it does not mark "example" is the
    code's default (flow and fairness: tests/unit/gateway/test_flow_config.py): a default
    changed in the code and not in the example would otherwise go unnoticed."""
    shown = yaml.safe_load(EXAMPLE.read_text())
    defaults = load_config(None, overrides=POOLS, environ={}).model_dump(mode="json")
    differ = {f"{section}.{name}": (value, defaults[section][name])
              for section in ("server", "upstream", "health", "routing", "epp", "tenancy",
                              "sync", "doctor")
              for name, value in shown[section].items() if value != defaults[section][name]}
    assert differ == {}


@pytest.mark.parametrize("url", ["notaurl", "http://:pw-sekrit@127.0.0.1:6379/0", "127.0.0.1:6379"])
def test_a_malformed_redis_url_is_a_config_error_that_hides_the_url(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides=POOLS, environ={"KVGATE_REDIS_URL": url})
    assert "KVGATE_REDIS_URL" in info.value.message
    assert url not in info.value.message and "sekrit" not in info.value.message


def test_redis_url_schemes_redis_accepts() -> None:
    for url in ("redis://127.0.0.1:6379/0", "rediss://h:6380", "unix:///run/redis.sock"):
        cfg = load_config(None, overrides=POOLS, environ={"KVGATE_REDIS_URL": url})
        assert cfg.redis_url is not None and cfg.redis_url.get_secret_value() == url


def test_log_level_is_case_insensitive() -> None:
    cfg = load_config(None, overrides={**POOLS, "server": {"log_level": "WARNING"}}, environ={})
    assert cfg.server.log_level == "warning"


# -- error wording: env sources, typos, whole-document checks, stray variables -------------
def test_an_error_from_the_environment_names_the_variable() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides=POOLS, environ={"KVGATE_SERVER__PORT": "abc"})
    assert "server.port:" in info.value.message
    assert "(from KVGATE_SERVER__PORT)" in info.value.message


@pytest.mark.parametrize(("name", "value", "shape", "fixed"), [
    ("KVGATE_TENANCY__METRICS_TENANTS", "acme,globex", "'[a, b]'", "[acme, globex]"),
    ("KVGATE_UPSTREAM__RETRY_STATUSES", "502,503", "'[a, b]'", "[502, 503]"),
    ("KVGATE_DOCTOR__THRESHOLDS", "ttft_high_s=2", "'{a: 1}'", "{ttft_high_s: 2}"),
])
def test_a_list_or_mapping_from_the_environment_says_how_to_write_it(
    name: str, value: str, shape: str, fixed: str
) -> None:
    """The value is read as YAML: "Input should be a valid list" alone left the form unsaid."""
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides=POOLS, environ={name: value})
    assert f"(from {name}, a " in info.value.message
    assert f"write it as YAML, e.g. {shape})" in info.value.message
    load_config(None, overrides=POOLS, environ={name: fixed})  # as it says: accepted


def test_a_misspelt_field_suggests_the_known_one() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides={**POOLS, "upstream": {"max_atempts": 3}}, environ={})
    assert "upstream.max_atempts: unknown field (did you mean max_attempts?)" \
        in info.value.message
    with pytest.raises(ConfigError) as info:  # inside a pool: the pool's own fields
        load_config(None, environ={}, overrides={
            "pools": {"a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"],
                            "api_key_evn": "X"}}})
    assert "pools.a.api_key_evn: unknown field (did you mean api_key_env?)" \
        in info.value.message
    with pytest.raises(ConfigError) as info:  # routing: a pydantic dataclass
        load_config(None, overrides={**POOLS, "routing": {"polcy": "x"}}, environ={})
    assert "routing.polcy: unknown field (did you mean policy?)" in info.value.message


def test_a_whole_document_error_has_no_stray_prefix() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, environ={}, overrides={
            **POOLS, "models": {"big": {"default": "a", "premium": "fp9"}}})
    assert info.value.message.splitlines()[1].strip() == "models.big.premium: unknown pool 'fp9'"


def test_a_short_admin_token_is_named_by_its_id() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides=POOLS,
                    environ={"KVGATE_ADMIN_TOKEN": "ops:short,ci:" + "c" * 24})
    assert "the admin token with id 'ops' has 5 characters" in info.value.message


def test_an_admin_token_id_given_twice_is_refused() -> None:
    """The audit log names a writer by its token's id: two tokens under one id (a rotation
    that kept the old id) could not be told apart."""
    tokens = "ops:" + "a" * 24 + ",ops:" + "b" * 24
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides=POOLS, environ={"KVGATE_ADMIN_TOKEN": tokens})
    assert "the id 'ops' is given twice" in info.value.message
    assert "a" * 24 not in info.value.message and "b" * 24 not in info.value.message


def test_a_kvgate_variable_that_maps_to_nothing_is_named() -> None:
    env = {"KVGATE_SERVER_PORT": "9000", "KVGATE_REDIS_URL": "", "KVGATE_CONFIG": "",
           "KVGATE_SALT_SECRET": "", "KVGATE_POOLKEY": "k", "KVGATE_SERVER__PORT": "9001"}
    pools = {"pools": {"a": {**POOLS["pools"]["a"], "api_key_env": "KVGATE_POOLKEY"}}}
    cfg = load_config(None, overrides=pools, environ=env)
    [line] = unknown_env(cfg, env)
    assert "KVGATE_SERVER_PORT: not a kvgate setting" in line and "KVGATE_SERVER__PORT" in line
    assert "ignored" not in line  # a stored pool's api_key_env may read it
    assert unknown_env(cfg, {k: v for k, v in env.items() if k != "KVGATE_SERVER_PORT"}) == []


# -- --no-auth listens on loopback unless a host is given ----------------------------------
def _serve_cfg(monkeypatch: pytest.MonkeyPatch, *argv: str, **env: str) -> KvgateConfig:
    monkeypatch.delenv("KVGATE_CONFIG", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return config_from_args(build_parser().parse_args(["--upstream", "http://127.0.0.1:9",
                                                       *argv]))


def test_no_auth_binds_loopback_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _serve_cfg(monkeypatch, "--no-auth")
    assert cfg.server.host == "127.0.0.1"
    assert any("127.0.0.1 only" in line for line in start_warnings(cfg))
    assert listening(cfg) == "listening on http://127.0.0.1:8000"
    monkeypatch.setenv("KVGATE_SALT_SECRET", "0123456789abcdef0123")
    assert _serve_cfg(monkeypatch).server.host == "0.0.0.0"  # with authentication


@pytest.mark.parametrize("how", ["flag", "env", "file"])
def test_a_given_host_wins_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, how: str
) -> None:
    if how == "flag":
        cfg = _serve_cfg(monkeypatch, "--no-auth", "--host", "0.0.0.0")
    elif how == "env":
        cfg = _serve_cfg(monkeypatch, "--no-auth", KVGATE_SERVER__HOST="0.0.0.0")
    else:
        path = tmp_path / "k.yaml"
        path.write_text(yaml.safe_dump({**POOLS, "server": {"host": "0.0.0.0"}}))
        monkeypatch.delenv("KVGATE_CONFIG", raising=False)
        cfg = config_from_args(build_parser().parse_args(["--no-auth", "--config", str(path)]))
    assert cfg.server.host == "0.0.0.0"
    warning = "unauthenticated gateway is reachable from the network"
    assert any(warning in line for line in start_warnings(cfg))


def test_listening_line_names_the_admin_port(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _serve_cfg(monkeypatch, "--no-auth", "--port", "8100",
                     KVGATE_SERVER__ADMIN_PORT="8101")
    assert listening(cfg) == ("listening on http://127.0.0.1:8100, "
                              "admin API on http://127.0.0.1:8101")


def test_no_admin_token_warns_even_with_config_tenants() -> None:
    env = {"KVGATE_SALT_SECRET": "0123456789abcdef0123"}
    cfg = load_config(None, overrides={**POOLS, "tenants": [{"id": "acme"}]}, environ=env)
    assert NO_ADMIN_WARNING in start_warnings(cfg)
    assert "add tenants to the config" not in NO_ADMIN_WARNING


def test_salt_secret_from_the_file_or_the_variable_never_two_that_differ(tmp_path: Path) -> None:
    """KVGATE_SALT_SECRET won silently over tenancy.salt_secret_file: a rotated file, or one
    that could not be read, was ignored while the old secret stayed in use."""
    from gateway.config import salt_secret

    secret = "s" * 40
    path = tmp_path / "salt"
    path.write_text(secret + "\n")
    with_file = {**POOLS, "tenancy": {"salt_secret_file": str(path)}}
    assert salt_secret(load_config(None, overrides=with_file, environ={})) == secret
    same = {"KVGATE_SALT_SECRET": secret}
    assert salt_secret(load_config(None, overrides=with_file, environ=same)) == secret
    other = load_config(None, overrides=with_file, environ={"KVGATE_SALT_SECRET": "t" * 40})
    with pytest.raises(ConfigError, match="differs from the file's first line") as err:
        salt_secret(other)
    assert "t" * 40 not in str(err.value) and secret not in str(err.value)
    path.unlink()
    with pytest.raises(ConfigError, match="cannot read it"):
        salt_secret(load_config(None, overrides=with_file, environ=same))


@pytest.mark.parametrize("name", ["a/b", "q\r\nx-evil: 1", "-lead"])
def test_a_pool_or_tier_name_in_the_file_is_a_name_as_through_the_admin_api(name: str) -> None:
    pool = {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}
    with pytest.raises(ConfigError, match="is not a name"):
        load_config(None, overrides={"pools": {name: pool}}, environ={})
    with pytest.raises(ConfigError, match="is not a name"):
        load_config(None, overrides={**POOLS, "tiers": {name: {}}}, environ={})
