"""The admin API's route tables (docs/admin-api.md, docs/tenants-and-admin.md) against the
admin API itself: every route they document is served with that method, and every route
served is documented (the schema the app serves at /admin/openapi.json is built from its
routes)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.admin import AdminDeps, create_admin_app
from gateway.tenancy import InMemoryStore

DOCS = Path(__file__).resolve().parents[2] / "docs"
ROW = re.compile(r"^\| `([A-Z, `]+) (/[^`? ]*)[^`]*` \|", re.M)


def _documented(page: str) -> set[tuple[str, str]]:
    """(method, path under /admin) of each row of the page's route table; `{id}` as written
    (`POST`, `GET /admin/tenants`: both methods)."""
    out = set()
    for methods, path in ROW.findall((DOCS / page).read_text()):
        for method in re.findall(r"[A-Z]+", methods):
            out.add((method, path.removeprefix("/admin")))
    return out


def _served() -> set[tuple[str, str]]:
    spec = create_admin_app(AdminDeps(store=InMemoryStore(), tokens=[])).openapi()
    out = set()
    for path, ops in spec["paths"].items():
        # the schema names parameters as the code does ({tenant_id}); the table as a user does
        shown = re.sub(r"\{tenant_id\}", "{id}", path.removeprefix("/admin"))
        out |= {(method.upper(), shown) for method in ops if method != "head"}
    return out


@pytest.mark.parametrize("page", ["admin-api.md", "tenants-and-admin.md"])
def test_the_route_table_is_the_admin_api(page: str) -> None:
    documented, served = _documented(page), _served()
    assert len(documented) >= 10, f"docs/{page}'s route table not found"
    assert sorted(documented - served) == [], "documented, not served"
    assert sorted(served - documented) == [], "served, not documented"
