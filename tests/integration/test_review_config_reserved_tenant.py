"""A tenant named `none` in the config file is refused at start, as the admin API refuses it.

`none` is the tenant label (metrics, the request log) of a request refused before its tenant
was known: the admin API was taught to refuse it, but `tenants: [{id: none}]` in kvgate.yaml
still started a gateway whose tenant `none` had its requests counted with every bad key's."""

from __future__ import annotations

from pathlib import Path

from tests.integration.test_cli_own_address import kvgate
from tests.support.procs import free_port

RULE = ("tenants.0.id: 'none' is reserved: it is the metric label and log value of requests "
        "refused before their tenant, tier and pool were known")


def write(tmp_path: Path, tenant: str) -> Path:
    path = tmp_path / "kvgate.yaml"
    path.write_text(f"server: {{port: {free_port()}}}\n"
                    "pools:\n  a: {served_model: m, replicas: ['http://127.0.0.1:9']}\n"
                    f"tenants:\n  - {{id: {tenant}}}\n")
    return path


def test_serve_refuses_a_tenant_named_none(tmp_path: Path) -> None:
    result = kvgate("serve", "--config", str(write(tmp_path, "none")))
    assert result.returncode == 2, result.stderr
    assert RULE in result.stderr
    assert "listening on" not in result.stderr and "Traceback" not in result.stderr


def test_config_check_names_it_and_takes_a_name_beside_it(tmp_path: Path) -> None:
    refused = kvgate("config", "check", str(write(tmp_path, "none")))
    assert refused.returncode != 0 and RULE in refused.stderr, refused.stderr
    taken = kvgate("config", "check", str(write(tmp_path, "none1")))
    assert taken.returncode == 0, taken.stderr
