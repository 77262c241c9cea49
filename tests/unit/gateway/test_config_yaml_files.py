"""The YAML a user copies or writes, read by the real loader: every example under examples/
and every config block in docs/ loads (docs drift), a key given twice in one mapping is
refused naming both places (PyYAML kept the last silently), a tab where indentation goes
says that YAML indents with spaces, and a boolean where a number goes in a process-level
section is refused naming the field (pydantic's lax mode read `port: true` as port 1)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from gateway.config import KvgateConfig, load_config
from gateway.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
POOLS = "pools:\n  a: {served_model: m, replicas: ['http://127.0.0.1:9']}\n"
SECTIONS = set(KvgateConfig.model_fields)
FENCE = re.compile(r"^```yaml\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _config_blocks() -> list[tuple[str, str]]:
    """(page:block number, text) of each ```yaml block in docs/ whose top-level keys are all
    config sections (an Envoy bootstrap or a Kubernetes manifest is not a kvgate config)."""
    out = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for n, block in enumerate(FENCE.findall(page.read_text()), 1):
            doc = yaml.safe_load(block)
            if isinstance(doc, dict) and set(doc) <= SECTIONS:
                out.append((f"{page.name}:{n}", block))
    return out


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_example_loads(path: Path) -> None:
    load_config(str(path), environ={})


def test_the_docs_have_config_blocks() -> None:
    """The finder below finds something: docs/flow-control.md and docs/doctor.md show one."""
    assert {name.split(":")[0] for name, _ in _config_blocks()} >= {"flow-control.md",
                                                                    "doctor.md"}


@pytest.mark.parametrize(("name", "block"), _config_blocks(), ids=lambda v: str(v)[:24])
def test_every_config_block_in_the_docs_loads(tmp_path: Path, name: str, block: str) -> None:
    path = tmp_path / "kvgate.yaml"
    doc = yaml.safe_load(block)
    path.write_text(block if "pools" in doc else POOLS + block)
    load_config(str(path), environ={})


@pytest.mark.parametrize(("text", "where"), [
    # a second section: the first one's port was dropped without a word
    ("server:\n  port: 9000\n" + POOLS + "server:\n  host: 127.0.0.1\n",
     "the key 'server' is repeated (only one would count) at line 5, column 1 "
     "(first given at line 1, column 1)"),
    # a field repeated lower down in its section
    (POOLS + "upstream:\n  max_attempts: 1\n  connect_timeout_s: 2\n  max_attempts: 5\n",
     "the key 'max_attempts' is repeated (only one would count) at line 6, column 3 "
     "(first given at line 4, column 3)"),
])
def test_a_key_given_twice_is_refused_naming_both(tmp_path: Path, text: str, where: str) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path), environ={})
    assert err.value.message == f"config file {path}: invalid YAML: {where}"


def test_a_merge_key_may_be_overridden(tmp_path: Path) -> None:
    """A merge (`<<:`, usually of an anchor) then one of its keys is YAML's way to override:
    not a repeated key."""
    path = tmp_path / "kvgate.yaml"
    path.write_text(POOLS + "upstream:\n  <<: {connect_timeout_s: 2, max_attempts: 1}\n"
                    "  max_attempts: 5\n")
    cfg = load_config(str(path), environ={})
    assert (cfg.upstream.connect_timeout_s, cfg.upstream.max_attempts) == (2, 5)


def test_a_tab_for_indentation_says_yaml_wants_spaces(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(POOLS + "server:\n\tport: 9000\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path), environ={})
    assert err.value.message == (
        f"config file {path}: invalid YAML: found character '\\t' that cannot start any token "
        "at line 4, column 1: YAML indents with spaces, not tabs "
        "(while scanning for the next token)")


@pytest.mark.parametrize(("section", "line"), [
    # port 1: pydantic's lax mode read true as 1
    ("server:\n  port: true", "server.port: a boolean where a number goes"),
    ("upstream:\n  retry_budget_min: no",
     "upstream.retry_budget_min: a boolean where a number goes"),
    ("routing:\n  load_factor: on", "routing.load_factor: a boolean where a number goes"),
    ("tenancy:\n  audit_cap: yes", "tenancy.audit_cap: a boolean where a number goes"),
    ("doctor:\n  thresholds: {ttft_high_s: on}", "doctor.thresholds: a boolean where a number"),
    ("health:\n  stall_after_s: off", "health.stall_after_s: a boolean where a number goes "
     "(YAML reads true/false, yes/no and on/off as booleans): write the number, or null"),
])
def test_a_boolean_for_a_number_is_refused_naming_the_field(
        tmp_path: Path, section: str, line: str) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(POOLS + section + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path), environ={})
    assert f"\n  {line}" in err.value.message


def test_a_boolean_for_a_number_from_a_variable_names_it() -> None:
    with pytest.raises(ConfigError) as err:
        load_config("", environ={"KVGATE_SERVER__PORT": "true"}, overrides=yaml.safe_load(POOLS))
    assert "server.port: a boolean where a number goes" in err.value.message
    assert "(from KVGATE_SERVER__PORT)" in err.value.message


def test_booleans_and_numbers_in_their_own_fields_still_load(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(POOLS + "server: {replica_header: off, port: '9000'}\n"
                    "health: {stall_after_s: 0}\ntenancy: {auth: no}\nflow: {enabled: yes}\n")
    cfg = load_config(str(path), environ={})
    assert (cfg.server.replica_header, cfg.server.port, cfg.health.stall_after_s) == (
        False, 9000, 0)
    assert (cfg.tenancy.auth, cfg.flow.enabled) == (False, True)
