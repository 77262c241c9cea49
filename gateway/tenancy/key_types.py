"""Which of kvgate's keys hold another type, for the log when Redis answers WRONGTYPE.

WRONGTYPE is no outage: another application or an operator wrote under `tenancy.namespace`,
and Redis's reply does not say which key. Retrying will not cure it; deleting the key (or
moving the other writer) will, so the log names it. Only the namespace's fixed keys are
checked (one round trip); a tenant's own keys are named where they are used (rate limits).
The generation counter holding a string that is no integer counts as a key of the wrong
type (`redis_records.counter`); it is not to be deleted (a counter back at 0 reads as an
emptied store: the gateways serve their last state, degraded, until the next write): the log
says what to set it to.
"""

from __future__ import annotations

import re

import redis.asyncio as aioredis
from redis.exceptions import RedisError

__all__ = ["EXPECTED", "WRONG_TYPE", "bumpable", "misplaced", "name_wrong_types", "wrong_types"]

WRONG_TYPE = "server replied WRONGTYPE"  # `redis_conn.failure_cause` of that reply
_INTEGER = re.compile(r"0|-?[1-9][0-9]{0,18}")  # as Redis writes a signed 64-bit integer
_INT64 = 2**63


def bumpable(value: str) -> bool:
    """An integer INCR counts on and can add one to (`redis_scripts._GUARD`): a signed
    64-bit one below the largest (there INCR overflows)."""
    return _INTEGER.fullmatch(value) is not None and -_INT64 <= int(value) < _INT64 - 1

EXPECTED = {
    "tenants": "hash", "keys": "hash", "policy": "hash", "salt_groups": "hash",
    "audit": "list", "journal": "list",
    "gen": "string", "seeded": "string", "present": "string",
    "routes": "stream",
}


async def wrong_types(client: aioredis.Redis, expected: dict[str, str]) -> list[str]:
    """``"<key> is a <type>, not a <type>"`` for each of `expected` (key -> type) that exists
    with another type (one round trip)."""
    async with client.pipeline(transaction=False) as pipe:
        for name in expected:
            pipe.type(name)
        found = await pipe.execute(raise_on_error=False)
    return _wrong(expected, found)


def _wrong(expected: dict[str, str], found: list[object]) -> list[str]:
    return [f"{name} is a {_text(got)}, not a {want}"
            for (name, want), got in zip(expected.items(), found, strict=True)
            if isinstance(got, str | bytes) and _text(got) not in ("none", want)]


async def misplaced(client: aioredis.Redis, namespace: str) -> list[str]:
    """``"<key> is a <type>, not a <type>"`` for each fixed key of another type, and
    ``"<ns>:gen is not an integer (SET it to <n>, ...)"``."""
    expected = {f"{namespace}:{part}": want for part, want in EXPECTED.items()}
    gen, journal = f"{namespace}:gen", f"{namespace}:journal"
    async with client.pipeline(transaction=False) as pipe:
        for name in expected:
            pipe.type(name)
        pipe.get(gen)
        pipe.lindex(journal, 0)
        *found, counter, head = await pipe.execute(raise_on_error=False)
    wrong = _wrong(expected, found)
    if isinstance(counter, str | bytes) and not bumpable(_text(counter)):
        newest = re.match(r"[0-9]{1,19} ", _text(head)) if isinstance(head, str | bytes) else None
        at = f"SET it to {int(newest[0]) + 1}, past" if newest else "SET it to an integer past"
        wrong.append(f"{gen} is not an integer ({at} the newest generation in {journal})")
    return wrong


async def name_wrong_types(client: aioredis.Redis, namespace: str, cause: str) -> str:
    """`cause`, with the keys to delete when it is WRONGTYPE (as it was if they cannot be
    read either)."""
    if cause != WRONG_TYPE:
        return cause
    try:
        wrong = await misplaced(client, namespace)
    except (RedisError, OSError):
        return cause
    return f"{cause}: {'; '.join(wrong)}" if wrong else cause


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
