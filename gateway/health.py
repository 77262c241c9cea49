"""Active health: poll every replica's `/health`, and learn served model names and context lengths.

A replica's `/v1/models` is read when it is new to its pool, back from an ejection or found
serving another model, and every `_CARDS_EVERY` probes (LoRA adapters are loaded and unloaded
at run time, vLLM's ``/v1/load_lora_adapter``): the adapters it lists (cards with a ``parent``)
are the pool's public names too, each routed to the replicas listing it. One listing models,
none of them the pool's (a wrong Service selector,
another model rolled out there), is taken out with the reason; one whose `/v1/models` says
nothing useful (404, late, refused) is not judged by it.

A task owned by the app's lifespan. Passive health (failures seen by real requests) lives in
`Replica`; once an ejection's back-off has expired this poller keeps a replica that still fails
`/health` out (a replica marked down is not tried before `/health` answers), and one that
answers becomes half-open (one trial request decides), so a replica that comes back is used
again without a restart. vLLM's `/health` reports only the engine's
errored flag (a hung engine's answers 200: a stalled replica, `gateway.stall`, stays out) and is
served on the same event loop as the requests, so a saturated replica
answers it late: a probe that times out is only *slow*, and ejects after
`health.slow_threshold` in a row -- unless anything came from it while it waited (first
tokens, whole answers, streamed chunks, a /metrics page: `Replica.reply_mark`): alive, only its
`/health` is late (a replica
serving well was ejected, and kept out, for a slow `/health` alone); a refused connection or
an explicit non-200 (vLLM's 503 for a dead engine) ejects at once. A probe that times out
while requests are there (waiting, or streaming) and nothing at all came from the replica
meanwhile finds it frozen (`Replica.frozen`: down, its waiting requests tried elsewhere, its
quiet streams ended). While no scrape carries
vLLM's sleep gauge, a dev-mode replica's ``/is_sleeping`` tells whether its engine sleeps.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable

import orjson

from gateway.config import HealthConfig
from gateway.errors import REFUSED
from gateway.pool import Pool, Pools
from gateway.replicas import Replica
from gateway.transport import TRANSPORT_ERRORS, connect_failure, refused

__all__ = ["HealthMonitor"]

log = logging.getLogger(__name__)

# a replica's /v1/models is read again after this many probes that did not read it (about
# 20 s at the default 2 s interval): adapters loaded or unloaded meanwhile are seen then
_CARDS_EVERY = 10


class HealthMonitor:
    def __init__(
        self, pools: Pools, cfg: HealthConfig, clock: Callable[[], float], quiet_s: float = 0.0,
    ) -> None:
        self._pools = pools
        self._cfg = cfg
        self._clock = clock
        # how long an alive replica may send nothing (its /metrics page may take the scrape
        # timeout): a shorter silence, one /health timeout, is no freeze (`_frozen`)
        self._quiet_s = quiet_s
        self._silent: dict[str, tuple[int, float]] = {}  # replica -> (reply mark, seen since)
        self._refusals: set[str] = set()  # replicas whose refusal of the key was logged
        # (replica, served name) asked for that model card's context length; a replica that
        # leaves the pool is forgotten, one that comes back after being down is asked again
        # (restarted, perhaps with another --max-model-len)
        self._carded: set[tuple[str, str | None]] = set()
        self._wrong_model: set[str] = set()  # replicas logged as serving another model
        self._unread: dict[str, int] = {}  # replica -> probes since its /v1/models was read
        # replicas whose /is_sleeping did not answer a sleep state (no dev mode) -> probes
        # since: asked again when found down, or after `_CARDS_EVERY` probes (restarted with
        # VLLM_SERVER_DEV_MODE between two probes, never seen down, it was never asked again)
        self._no_sleep_route: dict[str, int] = {}

    async def run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self._cfg.interval_s)

    async def poll_once(self) -> None:
        checks = [
            self._guarded(pool, r) for pool in self._pools.by_name.values() for r in pool.replicas
        ]
        # a replica that left its pool with requests of ours still there (its pod not ready:
        # hung, frozen) is checked until they are over: found down, those waiting for their
        # answer to start are cut and tried elsewhere (`Replica.mark_down`), as in its pool,
        # and -- found frozen -- its quiet streams ended; unchecked, they waited for their
        # first-byte timeout (5 minutes by default), a started stream for its idle timeout
        checks += [self._guarded(pool, r, draining=True) for r in self._pools.draining
                   if r.inflight > 0 and (pool := self._pools.pool_of(r)) is not None]
        present = {r.id for pool in self._pools.by_name.values() for r in pool.replicas}
        self._carded = {c for c in self._carded if c[0] in present}  # left: forgotten
        self._refusals &= present
        self._wrong_model &= present
        self._no_sleep_route = {rid: n for rid, n in self._no_sleep_route.items()
                                if rid in present}
        self._unread = {rid: n for rid, n in self._unread.items() if rid in present}
        checked = present | {r.id for r in self._pools.draining}  # (their silence goes on)
        self._silent = {rid: v for rid, v in self._silent.items() if rid in checked}
        await asyncio.gather(*checks)

    async def _guarded(self, pool: Pool, replica: Replica, draining: bool = False) -> None:
        """`_check`, its failure of an unforeseen kind that replica's alone: it is down (its
        checks go on). One such exception (a host name the resolver raised `UnicodeError`
        on, from a policy stored before names were checked) ended this task: no replica of
        any pool was checked again, the down ones never came back."""
        try:
            await self._check(pool, replica, draining)
        except Exception as exc:  # any kind: the other replicas' checks must go on
            reason = f"/health: {type(exc).__name__}"
            if replica.reason != reason:  # (once per run of such failures)
                log.error("replica health check failed", extra={
                    "pool": pool.name, "replica": replica.id, "reason": reason})
            replica.reason = reason
            replica.mark_down(self._clock(), request=False)

    def _frozen(self, replica: Replica, mark: int) -> bool:
        """`Replica.frozen`, once nothing came from it for the longer of a /health timeout
        and `quiet_s` (the scrape timeout): a busy vLLM whose /metrics page took longer
        than one /health timeout (within the scrape's) was read as frozen, its waiting
        non-streamed requests cut and run again elsewhere."""
        now = self._clock()
        silent_s = now - self._silent.get(replica.id, (mark, now))[1]
        if silent_s < max(self._cfg.timeout_s, self._quiet_s):
            return False
        return replica.frozen(mark, now, silent_s)

    async def _check(self, pool: Pool, replica: Replica, draining: bool = False) -> None:
        if not replica.probe_due(self._clock()):
            return
        mark = replica.reply_mark()  # all that came from it when the probe went out
        if self._silent.get(replica.id, (None,))[0] != mark:
            self._silent[replica.id] = (mark, self._clock())
        try:
            status, _ = await pool.transport.get(
                f"{replica.url}/health", self._cfg.timeout_s, pool.headers
            )
            replica.replies += 1
            ok = status == 200
            reason = f"/health answered {status}"
        except TimeoutError:  # slow, not dead (aiohttp's timeouts subclass TimeoutError)
            if self._frozen(replica, mark):
                return  # nothing at all came from it while requests waited: down, cut
            slow = f"/health: no answer within {self._cfg.timeout_s:g} s"
            if replica.state == "healthy" and replica.reply_mark() != mark:
                # anything from it meanwhile (an answer, a chunk, a /metrics page): alive,
                # /health is late. Finished answers alone were not enough: a replica busy
                # with long non-streamed requests finishes none within a probe, was ejected
                # and its requests cut and run again elsewhere (the fleet's work doubled)
                replica.record_probe_ok()
                return
            if replica.state == "healthy":
                replica.record_slow_probe(self._clock())
                if replica.state != "healthy":  # /readyz says why, as for the other causes
                    replica.reason = slow
                    log.warning("replica down: /health too slow",
                                extra={"pool": pool.name, "replica": replica.id})
            else:  # the half-open probe: no answer is no recovery (nor anything else from
                replica.reason = slow  # it meanwhile: its quiet streams are ended)
                replica.mark_down(self._clock(), request=False,
                                  started=replica.reply_mark() == mark)
            return
        except TRANSPORT_ERRORS as exc:  # refused, reset: down now
            ok = False
            why = connect_failure(exc, replica.url) if refused(exc) else type(exc).__name__
            reason = f"/health: {why}"
            if (_nothing_listening(exc) and replica.reason != reason  # (once per outage)
                    and (replica.scraped is not None or replica.attempts)):  # (it was up)
                replica.lost_cache = True
        if not ok:
            self._no_sleep_route.pop(replica.id, None)
            replica.reason = reason
            if replica.state == "healthy":
                log.warning("replica down", extra={"pool": pool.name, "replica": replica.id,
                                                   "reason": reason})
            replica.mark_down(self._clock(), request=False)
            return
        # its /v1/models is read when what it serves may have changed: new to the pool, back
        # from an ejection (restarted; or its requests failed: another model rolled out
        # there answers each 404), or found serving another model
        ask = not draining and (
            pool.served_model is None or replica.state == "ejected"
            or replica.id in self._wrong_model
            or (replica.id, pool.served_model) not in self._carded
            or self._unread.get(replica.id, 0) >= _CARDS_EVERY)
        self._unread[replica.id] = 0 if ask else self._unread.get(replica.id, 0) + 1
        cards = await self._cards(pool, replica) if ask else None
        if cards is not None and self._serves_another(pool, replica, cards):
            return
        replica.record_probe_ok()
        if not draining:
            await self._ask_sleeping(pool, replica)
        came_back = False
        if replica.state == "ejected":
            # /health answers: back in rotation when what ejected it was nothing answering
            # there (a restart), else half-open, the next request decides (it may answer
            # /health yet fail requests, as a faulted vLLM engine does); a stalled one stays
            # out (a hung engine answers /health), unlogged every probe
            replica.probe_recovered()
            came_back = replica.state != "ejected"
            if came_back:
                log.info("replica answers /health again",
                         extra={"pool": pool.name, "replica": replica.id})
        if cards is not None:
            self._learn_model(pool, replica, cards)
            self._learn_adapters(pool, replica, cards)

    async def _ask_sleeping(self, pool: Pool, replica: Replica) -> None:
        """Ask vLLM's dev-mode ``GET /is_sleeping`` whether its engine sleeps, while no scrape
        tells (no `vllm:engine_sleep_state`: ``--disable-log-stats``, an older vLLM). Only a
        dev-mode server can be put to sleep over HTTP (``POST /sleep`` is a dev route too),
        and its /health stays 200 while asleep: requests sent there waited for their
        first-byte timeout. A replica without the route (404, anything but a boolean) is not
        asked again until it is found down or `_CARDS_EVERY` probes later (a replica
        restarted in dev mode between two probes is never found down); a failed or late
        answer says nothing."""
        scraped = replica.scraped
        if scraped is not None and scraped.asleep is not None:
            return
        unasked = self._no_sleep_route.get(replica.id)
        if unasked is not None and unasked < _CARDS_EVERY:
            self._no_sleep_route[replica.id] = unasked + 1
            return
        try:
            status, body = await pool.transport.get(
                f"{replica.url}/is_sleeping", self._cfg.timeout_s, pool.headers)
        except TRANSPORT_ERRORS:  # (a timeout included)
            return
        try:
            said = orjson.loads(body) if status == 200 else None
        except ValueError:
            said = None
        asleep = said.get("is_sleeping") if isinstance(said, dict) else None
        if not isinstance(asleep, bool):
            self._no_sleep_route[replica.id] = 0
            return
        self._no_sleep_route.pop(replica.id, None)
        replica.record_is_sleeping(asleep)

    async def _cards(self, pool: Pool, replica: Replica) -> list[object] | None:
        """The model cards its /v1/models lists, or None when it does not tell (no such
        route, refused credentials, late, unreadable): then nothing is judged from them."""
        try:
            status, body = await pool.transport.get(
                f"{replica.url}/v1/models", self._cfg.timeout_s, pool.headers
            )
            if status in REFUSED and replica.id not in self._refusals:
                # the quick form cannot learn the pool's model without the replica's key
                self._refusals.add(replica.id)
                log.warning("replica refused the gateway's credentials (%d) on /v1/models: "
                            "set the pool's api_key_env to its --api-key", status,
                            extra={"pool": pool.name, "replica": replica.id})
            if pool.served_model is None:  # (a configured model: its requests tell, `judge`)
                _note_refusal(replica, status)
            self._carded.add((replica.id, pool.served_model))  # it answered: asked
            cards = orjson.loads(body)["data"] if status == 200 else None
        except TRANSPORT_ERRORS:  # (a timeout included)
            return None
        except (ValueError, KeyError, TypeError):
            return None
        return cards if isinstance(cards, list) else None

    def _serves_another(self, pool: Pool, replica: Replica, cards: list[object]) -> bool:
        """Its /v1/models lists models, none of them the pool's (a wrong Service selector,
        another model rolled out there): every request sent there would be answered 404 "The
        model does not exist", so it is taken out with the reason, logged once (and once when
        it serves the pool's model again)."""
        served = [c["id"] for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)]
        if pool.served_model is None or not served or pool.served_model in served:
            if replica.id in self._wrong_model:
                self._wrong_model.discard(replica.id)
                log.info("replica serves the pool's model again",
                         extra={"pool": pool.name, "replica": replica.id,
                                "model": pool.served_model})
            return False
        names = ", ".join(f"'{name}'" for name in served[:3])  # (LoRA adapters are listed too)
        names += f" and {len(served) - 3} more" if len(served) > 3 else ""
        replica.reason = f"serves model {names}, not the pool's '{pool.served_model}'"
        if replica.id not in self._wrong_model:
            self._wrong_model.add(replica.id)
            log.warning("replica down: %s", replica.reason,
                        extra={"pool": pool.name, "replica": replica.id})
        replica.mark_down(self._clock(), request=False)
        return True

    def _learn_model(self, pool: Pool, replica: Replica, cards: list[object]) -> None:
        """Quick form: the pool's served name is what its replicas list in /v1/models. Every
        pool: each replica's context length is the served model's card's ``max_model_len``
        there (each replica is asked once, and again when it comes back after being down:
        its length then is the replica's and the pool's; kvgate's own /v1/models shows the
        pool's, the router sends a prompt past one replica's to a longer one)."""
        first = cards[0] if cards else None
        name = first.get("id") if isinstance(first, dict) else None
        _learn_context(pool, replica, name if pool.served_model is None else pool.served_model,
                       cards)
        if isinstance(name, str) and pool.served_model is None:
            pool.served_model = name
            self._pools.refresh_public()
            log.info("learned served model", extra={"pool": pool.name, "model": name})

    def _learn_adapters(self, pool: Pool, replica: Replica, cards: list[object]) -> None:
        """The LoRA adapters its /v1/models lists (vLLM: a card whose ``parent`` is the base
        model): public names of the pool, sent under their own name to the replicas listing
        them (an adapter's KV is not the base model's: vLLM's block hash carries it)."""
        adapters = frozenset(
            c["id"] for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)
            and isinstance(c.get("parent"), str) and c["id"] != pool.served_model)
        if pool.by_id.get(replica.id) is not replica:  # left while its cards were read
            return
        before = pool.adapters.get(replica.id, frozenset())
        pool.adapters[replica.id] = adapters
        pool.lora_names |= adapters
        if adapters or before:  # (also one a request found unloaded: `Pool.unloaded`)
            self._pools.refresh_public()
        if before != adapters:
            shown = ", ".join(sorted(adapters)[:10]) or "none"
            log.info("replica's LoRA adapters", extra={
                "pool": pool.name, "replica": replica.id, "model": shown})


# its reason while it refuses kvgate's key on /v1/models (`_note_refusal`): /readyz said only
# "no replica answered", the 401 was in the log alone (the doctor's credentials rule reads
# the same words as a request's refusal, `gateway.verdicts.judge`)
_CARDS_REFUSED = "refused the gateway's credentials ({}) on /v1/models"


def _note_refusal(replica: Replica, status: int) -> None:
    """Name a refusal of its /v1/models in the replica's reason (/readyz), and forget it once
    it answers otherwise."""
    if status in REFUSED:
        replica.reason = _CARDS_REFUSED.format(status)
    elif replica.reason is not None and replica.reason.endswith(" on /v1/models"):
        replica.reason = None


def _learn_context(pool: Pool, replica: Replica, served: object, cards: object) -> None:
    """The replica's ``max_model_len`` from the card of its served model, when it has one; the
    pool's is the longest of its replicas' (the router sends a prompt past one replica's to a
    longer one)."""
    for card in cards if isinstance(cards, list) else ():
        if isinstance(card, dict) and card.get("id") == served:
            length = card.get("max_model_len")
            if isinstance(length, int) and not isinstance(length, bool) and length > 0:
                replica.max_model_len = length
                pool.context_learned()
            return


def _nothing_listening(exc: BaseException) -> bool:
    """The replica's host answered that no process listens at its port (ECONNREFUSED): its
    process is gone (stopped, restarting), and its prefix cache with it. A host that cannot
    be reached, a timeout or a reset says nothing of the process (a partition keeps it)."""
    os_error = getattr(exc, "os_error", exc)  # (aiohttp wraps it)
    return isinstance(os_error, OSError) and os_error.errno == errno.ECONNREFUSED
