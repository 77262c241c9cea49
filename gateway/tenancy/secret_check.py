"""Whether every gateway on one Redis derives cache salts from the same secret.

Each gateway derives its tenants' ``cache_salt`` (and the salted prefix features its routing
pins on) from ``KVGATE_SALT_SECRET`` and `tenancy.salt_encoding`. Two gateways started with
different ones (a secret rotated on some of them, a typo in one deployment) give one tenant
two salts: its requests miss the cache the other gateway's requests filled, and a salt group's
tenants share it only behind one gateway. Nothing failed, so nothing said so.

Each gateway writes a fingerprint of its secret and encoding (the first 16 hex digits of an
HMAC under the secret of a fixed message no salt is derived from: it tells nothing of the
secret nor of any salt) into ``<ns>:salt_secrets``, field = fingerprint, value = when it last
wrote it (wall clock: the gateways may run on several hosts), every `CHECK_S`. A field other
than its own written within `LIVE_S` is a live gateway with another secret: `reason` says so
(``/readyz`` degraded) and the log says it once, until that gateway is gone. Fields older than
`FORGET_S` are deleted (a secret rotated on every gateway). A Redis that does not answer, or
refuses, skips a round: its trouble is the store's to report. A key of another type at
``<ns>:salt_secrets`` (written by hand, or by another application) is not the store's trouble:
every round fails on it until it is deleted, so `reason` says so (it turned the check off
without a word: gateways with different secrets read ready, not degraded).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from gateway.tenancy.key_types import WRONG_TYPE
from gateway.tenancy.redis_conn import failure_cause

__all__ = ["CHECK_S", "LIVE_S", "SaltSecretCheck"]

log = logging.getLogger(__name__)

CHECK_S = 5.0  # between two writes and reads of the fingerprints
LIVE_S = 60.0  # a fingerprint written within this long is a gateway running now
FORGET_S = 3600.0  # a fingerprint not written for this long is deleted


class SaltSecretCheck:
    def __init__(
        self, client: aioredis.Redis, namespace: str, fingerprint: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._r = client
        self._key = f"{namespace}:salt_secrets"
        self._mine = fingerprint
        self._clock = clock
        self._others = 0  # live gateways with another secret, at the last check
        self._task: asyncio.Task[None] | None = None
        self._blocked: str | None = None  # why no round can run (a key of another type)

    def reason(self) -> str | None:
        """Why /readyz is degraded, or None (no secret, fingerprint or address in it)."""
        if self._blocked is not None:
            return self._blocked
        if not self._others:
            return None
        return (f"{self._others} other salt secret(s) in use on this Redis: a gateway started "
                "with another KVGATE_SALT_SECRET (or tenancy.salt_encoding) gives each tenant "
                "another cache_salt there (its cache is split, salt groups share it only "
                "behind one gateway): give every gateway the same secret")

    async def start(self) -> None:
        """Check once (the first /readyz knows), then every `CHECK_S`."""
        await self._round()
        self._task = asyncio.create_task(self._loop(), name="salt-secret-check")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(CHECK_S)
            await self._round()

    async def _round(self) -> None:
        """One `check`; a Redis away or refusing skips it, a key of another type blocks it."""
        try:
            await self.check()
        except ResponseError as exc:
            if failure_cause(exc) == WRONG_TYPE:
                await self._wrong_type()
            return
        except (RedisError, OSError):
            return
        if self._blocked is not None:
            log.info("the salt-secret check runs again (%s)", self._key)
            self._blocked = None

    async def _wrong_type(self) -> None:
        """Say (once, and in `reason` while it lasts) which key blocks the check."""
        found = "another type"
        with contextlib.suppress(RedisError, OSError):
            kind = await self._r.type(self._key)
            found = f"a {kind.decode() if isinstance(kind, bytes) else kind}"
        blocked = (f"the salt secret check cannot run: {self._key} is {found}, not a hash "
                   "(delete it); gateways on this Redis with different KVGATE_SALT_SECRETs "
                   "would not be told")
        if self._blocked is None:
            log.error("%s", blocked)
        self._blocked = blocked

    async def check(self) -> None:
        """Write this gateway's fingerprint, read the others' and judge them."""
        now = self._clock()
        async with self._r.pipeline(transaction=False) as pipe:
            pipe.hset(self._key, self._mine, str(now))
            pipe.hgetall(self._key)
            _, seen = await pipe.execute()
        others, stale = 0, []
        for field, value in seen.items():
            name = field.decode() if isinstance(field, bytes) else str(field)
            try:
                age = now - float(value)
            except (TypeError, ValueError):  # not ours to judge: written by someone else
                continue
            if name == self._mine:
                continue
            if age > FORGET_S:
                stale.append(name)
            elif age <= LIVE_S:
                others += 1
        if stale:
            await self._r.hdel(self._key, *stale)
        self._judge(others)

    def _judge(self, others: int) -> None:
        if others and not self._others:
            log.error("the gateways on this Redis derive cache salts from different secrets: "
                      "%d other salt secret(s) in use besides this gateway's (KVGATE_SALT_SECRET "
                      "or tenancy.salt_encoding differ); each tenant gets another cache_salt "
                      "behind each, splitting its cache: give every gateway the same", others)
        elif self._others and not others:
            log.info("every gateway on this Redis derives cache salts from one secret again")
        self._others = others
