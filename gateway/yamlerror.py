"""Reading YAML for the commands that read YAML files (the config, `kvgate admin policy
put|patch`): `safe_load`, PyYAML's safe loader refusing a key given twice in one mapping, and
its errors in one line (`one_line`: PyYAML's own text spreads over four or more lines). A file
that is not UTF-8 text is worded once for them all (`not_utf8`)."""

from __future__ import annotations

from typing import IO, Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode

__all__ = ["not_utf8", "one_line", "safe_load"]

MERGE_TAG = "tag:yaml.org,2002:merge"  # `<<: *anchor`: its keys may be overridden
# PyYAML's problem for a tab where indentation goes; YAML indents with spaces only
TAB_PROBLEM = "found character '\\t' that cannot start any token"
# PyYAML's problems for a line indented out of step with those above it (`expected <block
# end>, but found ...`), or a `key: value` where a value goes (a line indented deeper than its
# sibling, or `: ` inside an unquoted value), both worded in the parser's terms only
HINTS = {
    "expected <block end>": ": the line is indented differently from the lines above it",
    "mapping values are not allowed here": (
        ": a `key: value` where a value goes (a line indented deeper than the one above it, "
        "or `: ` in a value: quote the value)"),
}


class _UniqueKeyLoader(yaml.SafeLoader):
    """A key given twice in one mapping is an error (YAML 1.2 says a mapping's keys are
    unique): PyYAML kept the last silently, so a second `server:` section, or a field
    repeated lower down, dropped the first without a word."""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                seen = first.setdefault(key, key_node)
            except TypeError:  # an unhashable key: PyYAML's own error says so below
                continue
            if seen is not key_node:
                raise ConstructorError(
                    "first given", seen.start_mark,
                    f"the key {key!r} is repeated (only one would count)", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def safe_load(stream: str | IO[str]) -> Any:
    """`yaml.safe_load`, with a key given twice in one mapping refused (a `yaml.YAMLError`)."""
    return yaml.load(stream, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects


def not_utf8(exc: UnicodeDecodeError) -> str:
    """Why a YAML file could not be read as UTF-8 (saved as UTF-16, or not the file meant),
    where, and what to do."""
    return (f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}): "
            "save it as UTF-8")


def one_line(exc: yaml.YAMLError) -> str:
    """The problem where it was found, then what was being read and where that began."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return " ".join(str(exc).split())
    mark = exc.problem_mark
    line = f"{exc.problem} at line {mark.line + 1}, column {mark.column + 1}"
    if exc.problem == TAB_PROBLEM:
        line += ": YAML indents with spaces, not tabs"
    if exc.context and exc.context_mark is not None:
        start = exc.context_mark
        line += f" ({exc.context} at line {start.line + 1}, column {start.column + 1})"
    elif exc.context:
        line += f" ({exc.context})"
    return line + next((hint for start, hint in HINTS.items()
                        if (exc.problem or "").startswith(start)), "")
