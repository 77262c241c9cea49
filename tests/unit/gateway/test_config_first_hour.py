"""Configuration mistakes a new user makes in the first hour, and what the error says: a
section misspelt in a variable names the variable, a routing-core check names its field once,
a `KVGATE_CONFIG` that names no file says it came from the variable, a replica URL with no
host is refused where it is written (file, `--upstream`, `PUT /admin/policy`), and so is an
empty listen address."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import auth_secret, load_config
from gateway.errors import ConfigError
from gateway.policy_doc import PolicyValidationError, parse_policy

POOLS = {"pools": {"a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}}}


@pytest.mark.parametrize(("name", "line"), [
    ("KVGATE_SERVR__PORT", "servr: unknown field (did you mean server?) (from KVGATE_SERVR__PORT)"),
    ("KVGATE_UPSTREAMS__MAX_ATTEMPTS__X",
     "upstreams: unknown field (did you mean upstream?) (from KVGATE_UPSTREAMS__MAX_ATTEMPTS__X)"),
])
def test_a_misspelt_section_in_a_variable_names_the_variable(name: str, line: str) -> None:
    """An unknown field deeper down named its variable; a misspelt section did not, and the
    user's file has no `servr:` to find."""
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides=POOLS, environ={name: "1"})
    assert info.value.message.splitlines()[1].strip() == line


def test_a_document_error_does_not_name_an_unrelated_variable() -> None:
    """A whole-section check (admin_port = port) is not blamed on another variable of the
    section."""
    with pytest.raises(ConfigError) as info:
        load_config(None, environ={"KVGATE_SERVER__LOG_LEVEL": "info"},
                    overrides={**POOLS, "server": {"port": 9000, "admin_port": 9000}})
    assert "KVGATE_SERVER__LOG_LEVEL" not in info.value.message


@pytest.mark.parametrize(("routing", "line"), [
    ({"load_factor": 0.5}, "routing.load_factor must be >= 1.0"),
    ({"prior_weight": 0}, "routing: prior_prefill_tps, prior_weight, fleet_weight, "
                          "tie_quantum_s must be > 0"),
])
def test_a_routing_core_check_names_its_field_once(routing: dict[str, float], line: str) -> None:
    """The routing core's own messages start with the section: not "routing: routing.x"."""
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides={**POOLS, "routing": routing}, environ={})
    assert info.value.message.splitlines()[1].strip() == line


def test_a_kvgate_config_that_names_no_file_says_it_came_from_the_variable() -> None:
    """`KVGATE_CONFIG` left from another shell: the error said "config file X" and nothing
    on the command line named X."""
    with pytest.raises(ConfigError) as info:
        load_config(None, environ={"KVGATE_CONFIG": "/nonexistent/kvgate.yaml"})
    assert info.value.message == ("config file /nonexistent/kvgate.yaml (from KVGATE_CONFIG): "
                                  "No such file or directory")
    with pytest.raises(ConfigError) as info:  # given as an argument: named as given
        load_config("/nonexistent/kvgate.yaml", environ={"KVGATE_CONFIG": "/elsewhere.yaml"})
    assert info.value.message == "config file /nonexistent/kvgate.yaml: No such file or directory"


def test_an_invalid_kvgate_config_file_says_it_came_from_the_variable(tmp_path: Path) -> None:
    path = tmp_path / "k.yaml"
    path.write_text("server: [\n")
    with pytest.raises(ConfigError) as info:
        load_config(None, environ={"KVGATE_CONFIG": str(path)})
    assert info.value.message.startswith(f"config file {path} (from KVGATE_CONFIG): invalid YAML")


@pytest.mark.parametrize("url", ["http://:9001", "http://user:pw@:9001", "https://:443/"])
def test_a_replica_url_without_a_host_is_refused(url: str) -> None:
    """It was taken: the replica was named `None:9001`, its probes failed with aiohttp's
    InvalidUrlClientError, and the pool never served."""
    with pytest.raises(ConfigError) as info:
        load_config(None, environ={}, overrides={"pools": {"a": {"replicas": [url]}}})
    assert "pools.a: a replica URL needs a valid host and port" in info.value.message
    assert "pw" not in info.value.message
    with pytest.raises(PolicyValidationError) as err:  # PUT /admin/policy: the same 400
        parse_policy({"pools": {"a": {"replicas": [url]}}})
    assert "a replica URL needs a valid host and port" in str(err.value)


@pytest.mark.parametrize("host", ["", "  "])
def test_an_empty_listen_address_is_refused_naming_the_variable(host: str) -> None:
    """`KVGATE_SERVER__HOST=` (a template's unset value) bound every interface -- with
    `--no-auth` too, whose default is 127.0.0.1 -- and said `listening on http://:8000`."""
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides=POOLS, environ={"KVGATE_SERVER__HOST": host})
    line = info.value.message.splitlines()[1].strip()
    assert line.startswith("server.host: empty: give an address")
    assert line.endswith("(from KVGATE_SERVER__HOST)")


@pytest.mark.parametrize(("raw", "line"), [
    ({"models": {"m": "a"}}, "models.m: Input should be a valid dictionary: the pool per tier, "
                             "e.g. {default: fp8, free: awq}"),
    ({"tenants": {"acme": {"tier": "default"}}},
     "tenants: Input should be a valid list: a list of tenants, e.g. [{id: acme, tier: premium}]"),
    ({"pools": {"a": {"replicas": "http://127.0.0.1:9"}}},
     "pools.a.replicas: Input should be a valid list: a list of URLs, e.g. "
     "[http://10.0.0.1:8000]"),
])
def test_a_policy_field_in_another_shape_says_the_shape(raw: dict[str, object],
                                                        line: str) -> None:
    """`models: {llama: fp8}` (a model mapped to a pool, not per tier) was "Input should be a
    valid dictionary", and what it should map was left to the docs."""
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides={**POOLS, **raw}, environ={})
    assert info.value.message.splitlines()[1].strip() == line


@pytest.mark.parametrize(("tenant", "field"), [({"id": "acme corp"}, "tenants.0.id"),
                                               ({"id": "a", "salt_group": "-g"},
                                                "tenants.0.salt_group")])
def test_a_tenant_name_that_is_not_a_name_says_what_a_name_is(tenant: dict[str, str],
                                                               field: str) -> None:
    """It quoted the regular expression: "String should match pattern '^[A-Za-z0-9]...'"."""
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides={**POOLS, "tenants": [tenant]}, environ={})
    line = info.value.message.splitlines()[1].strip()
    assert line.startswith(f"{field}: {tenant[field.rsplit('.', 1)[1]]!r} is not a name: 1 to "
                           "64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    assert "pattern" not in line


@pytest.mark.parametrize("text", ["", "\n", "  \nsecond-line-0123456789\n"])
def test_an_empty_salt_secret_file_is_named_not_asked_for(tmp_path: Path, text: str) -> None:
    """It said "no salt secret is configured: set KVGATE_SALT_SECRET ... or
    tenancy.salt_secret_file", the setting the user had just set."""
    path = tmp_path / "salt"
    path.write_text(text)
    cfg = load_config(None, environ={}, overrides={
        **POOLS, "tenancy": {"salt_secret_file": str(path)}})
    with pytest.raises(ConfigError) as info:
        auth_secret(cfg)
    assert info.value.message == (f"tenancy.salt_secret_file: {path}: its first line, the "
                                  "secret, is empty")


def test_a_short_secret_from_the_file_names_the_file(tmp_path: Path) -> None:
    """"KVGATE_SALT_SECRET must be at least 16 bytes", with no such variable set."""
    path = tmp_path / "salt"
    path.write_text("short\n")
    cfg = load_config(None, environ={}, overrides={
        **POOLS, "tenancy": {"salt_secret_file": str(path)}})
    with pytest.raises(ConfigError) as info:
        auth_secret(cfg)
    assert info.value.message == ("tenancy.salt_secret_file: the secret (its first line) must "
                                  "be at least 16 bytes; it has 5: make one with `openssl rand "
                                  "-hex 32`")
    env = load_config(None, overrides=POOLS, environ={"KVGATE_SALT_SECRET": "short"})
    with pytest.raises(ConfigError) as info:
        auth_secret(env)
    assert info.value.message == ("salt_secret: KVGATE_SALT_SECRET must be at least 16 bytes; "
                                  "it has 5: make one with `openssl rand -hex 32`")


@pytest.mark.parametrize(("text", "line"), [
    ("upstream:\n  retry_statuses: 500\n",
     "upstream.retry_statuses: Input should be a valid list (got 500): write it as a list, "
     "[500]"),
    ("tenancy:\n  metrics_tenants: acme\n",
     "tenancy.metrics_tenants: Input should be a valid list (got 'acme'): write it as a list, "
     "[acme]"),
    ("doctor:\n  thresholds: 5\n",
     "doctor.thresholds: Input should be a valid dictionary (got 5): a mapping, e.g. {a: 1}"),
    # pools written as a list of named entries, as Kubernetes manifests are
    ("pools:\n  - name: a\n    replicas: ['http://127.0.0.1:9']\n",
     "pools: Input should be a valid dictionary: pool name -> pool, e.g. "
     "{fp8: {replicas: [http://10.0.0.1:8000]}}"),
    ("tiers:\n  - free\n", "tiers: Input should be a valid dictionary: tier name -> tier, e.g. "
                          "{free: {limits: {rpm: 60}}}"),
])
def test_a_list_or_mapping_of_the_wrong_type_in_the_file_says_what_it_got(
        tmp_path: Path, text: str, line: str) -> None:
    """"Input should be a valid list" said neither what the file held nor how to write it
    (a variable's value got the form; a file's did not)."""
    path = tmp_path / "kvgate.yaml"
    pools = "pools:\n  a: {served_model: m, replicas: ['http://127.0.0.1:9']}\n"
    path.write_text(text if text.startswith("pools:") else pools + text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path), environ={})
    assert info.value.message.splitlines()[1].strip() == line


def test_a_section_with_every_field_commented_out_is_its_defaults(tmp_path: Path) -> None:
    """examples/kvgate.yaml copied and a section's fields commented out: YAML reads the
    section line as null, which was "server: Input should be a mapping (got None)"."""
    path = tmp_path / "kvgate.yaml"
    path.write_text("pools:\n  a: {served_model: m, replicas: ['http://127.0.0.1:9']}\n"
                    "server:\n#  port: 9000\nflow:\n#  enabled: true\ntenants:\n")
    cfg = load_config(str(path), environ={})
    assert (cfg.server.port, cfg.flow.enabled, cfg.tenants) == (8000, False, [])
    path.write_text("pools:\n#  a: {replicas: ['http://127.0.0.1:9']}\n")
    with pytest.raises(ConfigError) as info:  # no pool at all: as for a file without pools
        load_config(str(path), environ={})
    assert info.value.message == f"pools: at least one pool is required in {path} (or use " \
                                 "--upstream URL)"
