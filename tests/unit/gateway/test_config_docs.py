"""docs/configuration.md against the code: every field its sections table names for a
process-level section exists under that name, and a default it states is the code's
(examples/kvgate.yaml is held to the same in test_config.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import load_config

DOC = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"
POOLS = {"pools": {"a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}}}
SECTIONS = ("server", "upstream", "health", "routing", "epp", "tenancy", "sync", "flow", "doctor")
UNITS = {"KiB": 2**10, "MiB": 2**20}


def _row(section: str) -> str:
    """The "main fields (default)" cell of the section's row."""
    for line in DOC.read_text().splitlines():
        if line.startswith(f"| `{section}` |"):
            return line.split(" | ")[2]
    raise AssertionError(f"docs/configuration.md has no row for {section}")


def _documented(cell: str) -> dict[str, str | None]:
    """Field name -> the text of its parenthesis (None without one). A name is a backticked
    word outside parentheses; `a` / `b` (x) gives both the same parenthesis."""
    out: dict[str, str | None] = {}
    pending: list[str] = []
    depth, i = 0, 0
    while i < len(cell):
        ch = cell[i]
        if ch == "`" and depth == 0:
            end = cell.index("`", i + 1)
            pending.append(cell[i + 1:end])
            out[pending[-1]] = None
            i = end + 1
            continue
        if ch == "(":
            if depth == 0:
                start = i + 1
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                for name in pending:
                    out[name] = cell[start:i]
                pending = []
        elif ch == "," and depth == 0:
            pending = []
        i += 1
    return out


def _stated(text: str) -> tuple[bool, Any]:
    """(True, value) when the parenthesis starts with a value to compare with the code's."""
    if re.match(r"`[^`]*` or ", text):  # the choices, not the default
        return False, None
    if text.startswith("`"):  # a code span, whole: `[500, 502]`
        head = text[:text.index("`", 1) + 1]
    else:
        head = re.split(r"[,:;]\s", text, maxsplit=1)[0].strip()
    if " or " in head:  # the choices, not the default
        return False, None
    if head in ("none", "null"):
        return True, None
    if head in ("true", "false"):
        return True, head == "true"
    if head.startswith("`") and head.endswith("`"):
        inner = head.strip("`")
        return True, yaml.safe_load(inner) if inner[:1] in "[{" else inner
    number = re.fullmatch(r"(\d+(?:\.\d+)?)(?: (KiB|MiB))?", head)
    if number:
        return True, float(number[1]) * UNITS.get(number[2] or "", 1)
    return False, None


@pytest.mark.parametrize("section", SECTIONS)
def test_the_sections_table_names_real_fields_with_their_defaults(section: str) -> None:
    defaults = load_config(None, overrides=POOLS, environ={}).model_dump(mode="json")[section]
    documented = _documented(_row(section))
    assert documented, section
    unknown = sorted(set(documented) - set(defaults))
    assert unknown == [], f"docs/configuration.md names {section} fields the code lacks"
    differ = {}
    for name, text in documented.items():
        stated, value = _stated(text or "")
        if stated and value != defaults[name]:
            differ[f"{section}.{name}"] = (text, defaults[name])
    assert differ == {}


def test_the_checker_catches_a_renamed_field_and_a_changed_default() -> None:
    """The parser reads what it should: a wrong name and a wrong default are seen."""
    cell = ("`port` (8000), `max_body_bytes` (4 MiB), `prot` (1), `cors_allowed_origins` / "
            "`cors_allowed_methods` (`[\"*\"]`), `max_connections` (1024, per replica: "
            "[more](x.md#y)), `client_salt` (`strip` or `reject`), `retry_statuses` (`[500, 502]`)")
    documented = _documented(cell)
    assert set(documented) == {"port", "max_body_bytes", "prot", "cors_allowed_origins",
                               "cors_allowed_methods", "max_connections", "client_salt",
                               "retry_statuses"}
    assert _stated(documented["max_body_bytes"] or "") == (True, 4 * 2**20)
    assert _stated(documented["cors_allowed_methods"] or "") == (True, ["*"])
    assert _stated(documented["max_connections"] or "") == (True, 1024)
    assert _stated(documented["client_salt"] or "")[0] is False
    assert _stated(documented["retry_statuses"] or "") == (True, [500, 502])
