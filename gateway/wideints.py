"""Integers beyond 64 bits in a request body: a 400, never a value changed on the way.

orjson parses integers from -2**63 to 2**64 - 1 exactly and reads a longer integer literal as
a float, so ``"seed": 123456789012345678901234567890`` would reach the replica as
``1.2345678901234568e+29`` (orjson cannot write such an integer back either). Such a literal
has at least 19 digits in a row: `check_wide_ints` looks for a run that long (a C-speed
translate and search, ~1.5 ns a byte: ~6 µs for a 4 KB body), and only when there is one
(a long number, or a long run of digits in a string) reads the body again with the standard
library's parser, whose integers are exact, to tell.
"""

from __future__ import annotations

import json

from gateway.errors import BadRequest

__all__ = ["check_wide_ints", "wide_int_error"]

_MIN, _MAX = -(2**63), 2**64 - 1  # what orjson reads (and writes) as an integer
_DIGITS_ONLY = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))  # digit -> "0"
_RUN = b"0" * 19  # the shortest literal outside [_MIN, _MAX] has 19 digits


class _Wide(Exception):
    def __init__(self, literal: str) -> None:
        super().__init__(literal)
        self.literal = literal


def _exact(literal: str) -> int:
    value = int(literal)  # at most ~310 digits: orjson refuses longer ones (infinity)
    if not _MIN <= value <= _MAX:
        raise _Wide(literal)
    return value


def check_wide_ints(raw: bytes) -> None:
    """Raise a 400 (`BadRequest`) when the JSON text `raw` (valid: orjson read it) holds an
    integer outside what orjson keeps exact."""
    if _RUN not in raw.translate(_DIGITS_ONLY):
        return
    try:
        json.loads(raw, parse_int=_exact)
    except _Wide as exc:
        raise wide_int_error(exc.literal) from None


def wide_int_error(literal: str | None = None) -> BadRequest:
    """The 400 for an integer beyond 64 bits (`literal`, shortened, when known)."""
    shown = ""
    if literal is not None:
        shown = f" ({literal if len(literal) <= 24 else literal[:20] + '...'})"
    return BadRequest(f"The request body has an integer beyond 64 bits{shown}; integers must "
                      "be between -2**63 and 2**64-1.")
