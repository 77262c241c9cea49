"""The Redis store's lifecycle and pub/sub listener: change notifications, and the admin
addresses throttled by any gateway (`redis_auth_failures`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from redis.exceptions import RedisError, ResponseError

from gateway.errors import StoreUnreachable
from gateway.tenancy.models import Change
from gateway.tenancy.redis_auth_failures import throttled_address, throttled_now
from gateway.tenancy.redis_base import (
    EVICTION_CHECK_S,
    RETRY_MAX_S,
    THROTTLES_CLOSED_S,
    THROTTLES_WAIT_S,
    RedisBase,
)
from gateway.tenancy.redis_conn import failure_cause
from gateway.tenancy.redis_records import parse_change, text

__all__ = ["RedisListening"]

# the store's log lines keep the logger name operators and tests filter on
log = logging.getLogger("gateway.tenancy.redis_store")


class RedisListening(RedisBase):
    """The store's start and close, and its pub/sub listener."""

    async def start(self) -> None:
        await self._say_if_evicting()  # before the first /readyz; then the listener's
        self._evictions_due = asyncio.get_running_loop().time() + EVICTION_CHECK_S
        if self._listen and self._listener is None:
            self._listener = asyncio.create_task(self._listen_loop(), name="tenancy-pubsub")

    async def _say_if_evicting(self) -> None:
        """A Redis that evicts any key when full (``maxmemory-policy allkeys-*``) takes
        kvgate's tenants, keys, policy, its bootstrap marker (a wipe, each time) and leases
        with it: say so (`evicting`, which /readyz reports as degraded; the log once, and
        again when it changes), at start and every `EVICTION_CHECK_S` (a policy changed with
        CONFIG SET at run time). It was said once in the log at start only: /readyz and the
        doctor read all well until keys vanished. Nothing is said without a `maxmemory` (it
        never evicts), where CONFIG is refused (an ACL user without it, a managed Redis that
        renamed it: not asked again, each refusal was an ACL LOG entry) or Redis does not
        answer."""
        if self._config_refused:
            return
        try:
            found = await self._r.config_get("maxmemory*")
        except ResponseError:  # NOPERM, an unknown (renamed) command: so it stays
            self._config_refused = True
            return
        except (RedisError, OSError):
            return
        policy = text(found.get("maxmemory-policy") or "")
        if not (policy.startswith("allkeys-") and found.get("maxmemory") not in (None, "0")):
            if self.evicting is not None:
                log.info("Redis at %s no longer evicts kvgate's keys (maxmemory-policy %s)",
                         self.reach.address, policy or "unknown",
                         extra={"redis": self.reach.address})
            self.evicting = None
            return
        evicting = (f"Redis evicts any key when it is full (maxmemory-policy {policy}): "
                    "tenants, API keys, the policy and concurrency leases may vanish; run it "
                    "with maxmemory-policy noeviction")
        if evicting != self.evicting:
            log.warning("Redis at %s evicts any key when it is full (maxmemory-policy %s): "
                        "kvgate's tenants, API keys, policy and concurrency leases may be "
                        "evicted, each eviction of its bootstrap marker read as a wiped store; "
                        "give kvgate a Redis with maxmemory-policy noeviction", self.reach.address,
                        policy, extra={"redis": self.reach.address})
        self.evicting = evicting

    async def close(self) -> None:
        self._closing = True
        if self._listener is not None:
            # redis-py may turn a cancellation inside a read into its own TimeoutError, so the
            # loop also checks `_closing`; cancel again until the task has really ended.
            while not self._listener.done():
                self._listener.cancel()
                await asyncio.wait({self._listener}, timeout=0.5)
            self._listener = None
        await self._r.aclose()

    async def _listen_loop(self) -> None:
        backoff = 0.1
        while not self._closing:
            pubsub = self._r.pubsub()
            try:
                await pubsub.subscribe(self.channel, self._k("admin_auth"))
                self.reach.connected()
                self._notify(Change("resync"))  # messages may have been missed while away
                backoff = 0.1
                await self._tell_throttled()  # the addresses throttled meanwhile
                while True:
                    if (now := asyncio.get_running_loop().time()) >= self._evictions_due:
                        self._evictions_due = now + EVICTION_CHECK_S
                        await self._say_if_evicting()
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is None:
                        continue
                    if msg.get("channel") == self.channel:
                        self._notify(parse_change(msg.get("data")))
                    elif (said := throttled_address(str(msg.get("data")))) is not None:
                        self._tell(*said)
            except (RedisError, OSError) as exc:
                self._throttles_read.set()  # not read: an admin request does not wait on it
                if self._closing:
                    return
                self.reach.failed(failure_cause(exc))
                await asyncio.sleep(backoff)
                backoff = min(RETRY_MAX_S, backoff * 2)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis 8.2

    async def _tell_throttled(self) -> None:
        """The addresses throttled now, told (`_tell`). Refused (an ACL without SCAN): logged,
        and the failures published from now on are still told. Read at each subscription,
        whether anyone listens yet or not: the admin app that listens is built after the
        store starts, and the addresses were read only once it listened and the listener's
        next wait for a message had ended (up to a second after a gateway's start, when a
        throttled address's valid token got in)."""
        try:
            found = await throttled_now(self._r, self._k("admin_auth", ""))
        except ResponseError as exc:
            log.warning("tenancy store: the admin addresses throttled before this gateway "
                        "listened could not be read (%s): it throttles those that fail here "
                        "or are throttled from now on", failure_cause(exc),
                        extra={"redis": self.reach.address})
            found = []
        finally:
            self._throttles_read.set()
        for address, level in found:
            self._tell(address, level)

    def _tell(self, address: str, level: float) -> None:
        """`on_auth_throttled`, or kept for `tell_throttles_to` while nobody listens (the
        lowest level of an address: it throttles a little longer, never shorter)."""
        if self.on_auth_throttled is not None:
            self.on_auth_throttled(address, level)
        else:
            self._untold[address] = min(level, self._untold.get(address, level))

    def tell_throttles_to(self, tell: Callable[[str, float], None]) -> None:
        self.on_auth_throttled = tell
        untold, self._untold = self._untold, {}
        for address, level in untold.items():
            tell(address, level)

    async def throttles_read(self) -> None:
        """Wait (`THROTTLES_WAIT_S` at most) for the addresses throttled before this gateway
        listened. Not read by then, the admin request is a 503 with Retry-After, not let in
        unchecked (on a loaded machine the read took longer and a throttled address's valid
        token was taken), until `THROTTLES_CLOSED_S` after the first wait: a listener that
        neither reads nor fails (a Redis that takes the connection and answers nothing)
        keeps the admin API closed no longer."""
        if self._listener is None or self._throttles_read.is_set():
            return
        loop = asyncio.get_running_loop()
        if self._throttles_since is None:
            self._throttles_since = loop.time()
        left = self._throttles_since + THROTTLES_CLOSED_S - loop.time()
        try:
            await asyncio.wait_for(self._throttles_read.wait(), min(THROTTLES_WAIT_S, left))
        except TimeoutError:
            if loop.time() - self._throttles_since < THROTTLES_CLOSED_S:
                raise StoreUnreachable("timeout") from None
            self._throttles_read.set()
            log.warning("the addresses throttled before this gateway listened were not read "
                        "in %.0f s: admin requests are checked without them", THROTTLES_CLOSED_S,
                        extra={"redis": self.reach.address})

