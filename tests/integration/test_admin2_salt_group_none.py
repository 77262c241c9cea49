"""`none` as a salt group's name is refused, by the admin API and in the config file's tenants.

`kvgate admin tenants update ID --salt-group none` sends null (leave the group), as the limit
flags take `none` for "no value"; yet the admin API made a group named "none" when asked for
one, so the CLI could neither set nor tell apart a group the API had made. `none` was already
refused as a tenant, tier or pool name (the label of a request refused before they were
known); a salt group is refused the same way, with the same rule.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.integration import test_admin_reserved_names
from tests.integration.test_cli_own_address import kvgate
from tests.support.procs import free_port

admin = test_admin_reserved_names.admin  # its gateway and admin client (a module fixture)
RULE = ("'none' is reserved: it is the metric label and log value of requests refused before "
        "their tenant, tier and pool were known")


def _refused(r: httpx.Response) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "salt_group" and RULE in err["message"], err


def test_creating_a_tenant_in_group_none_is_refused(admin: httpx.Client) -> None:
    _refused(admin.post("/tenants", json={"id": "grouped", "salt_group": "none"}))
    assert admin.get("/tenants/grouped").status_code == 404  # nothing written
    made = admin.post("/tenants", json={"id": "grouped", "salt_group": "none1"})
    assert made.status_code == 201, made.text  # only that name
    assert made.json()["salt_group"] == "none1"


def test_moving_a_tenant_to_group_none_is_refused(admin: httpx.Client) -> None:
    assert admin.post("/tenants", json={"id": "mover", "salt_group": "team"}).status_code == 201
    _refused(admin.patch("/tenants/mover", json={"salt_group": "none"}))
    assert admin.get("/tenants/mover").json()["salt_group"] == "team"  # unchanged
    left = admin.patch("/tenants/mover", json={"salt_group": None})  # what the CLI's none sends
    assert left.status_code == 200, left.text
    assert left.json()["salt_group"] is None


def _config(tmp_path: Path, group: str) -> Path:
    path = tmp_path / "kvgate.yaml"
    path.write_text(f"server: {{port: {free_port()}}}\n"
                    "pools:\n  a: {served_model: m, replicas: ['http://127.0.0.1:9']}\n"
                    f"tenants:\n  - {{id: acme, salt_group: {group}}}\n")
    return path


def test_the_config_file_refuses_it_too(tmp_path: Path) -> None:
    served = kvgate("serve", "--config", str(_config(tmp_path, "none")))
    assert served.returncode == 2, served.stderr
    assert f"tenants.0.salt_group: {RULE}" in served.stderr
    assert "listening on" not in served.stderr and "Traceback" not in served.stderr
    checked = kvgate("config", "check", str(_config(tmp_path, "none")))
    assert checked.returncode != 0 and f"tenants.0.salt_group: {RULE}" in checked.stderr
    taken = kvgate("config", "check", str(_config(tmp_path, "nonesuch")))
    assert taken.returncode == 0, taken.stderr
