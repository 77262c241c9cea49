"""What both edges do with a request before a replica gets it: admit, plan, rewrite, pick.

kvgate has two edges over one core: the HTTP proxy (`proxy.py`), which relays the bytes
itself, and the Envoy endpoint picker (`gateway/epp/`), which hands Envoy a destination and
the rewritten body. Both call `Preparer`: `identify` (API key -> tenant, in memory), then
`prepare` (the body parsed once, admission against the tenant's limits with its
x-ratelimit-* headers, the tier plan from the principal's policy snapshot -- pool,
spill-over, salted features --, the body rewritten for the pool: served model,
``cache_salt``, ``priority``, usage for streams -- and the router's `Decision`). The
request's state lands on the `ProxiedRequest`, which both edges settle the same way
(`finish`). `subset`: the picker's data plane may restrict the pick to some endpoints
(the endpoint picker protocol's subset hint); an empty or foreign subset is a 503.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import replace
from time import perf_counter
from typing import TypeVar

from gateway.body import ParsedBody, parse_body, rewrite_body
from gateway.doctor.sharing import PrefixSharing
from gateway.errors import NoReplicaAvailable, NotFound, ResponseLookupFailed, shown_name
from gateway.flow import FlowGate, asked_tokens
from gateway.logs import log_request
from gateway.metrics import GatewayMetrics
from gateway.multipart import parse_form
from gateway.planner import PREFIX_KINDS, Plan, Planner
from gateway.pool import Pool, Pools
from gateway.request import ProxiedRequest, rate_limit_headers
from gateway.responses import ResponseStore, home_out
from gateway.tenancy.edge import TenantGate
from gateway.tenancy.limits import Admission
from gateway.tenancy.resolver import Principal
from gateway.vllm_routes import PRIORITIZED, SALTED, adapt
from routing.router import NoCandidate, Router
from routing.types import Decision, ReplicaView, RequestFeatures

__all__ = ["OFF_LOOP_BYTES", "OffLoop", "Preparer", "unserved"]

T = TypeVar("T")

# A body at least this large is parsed, and its prefix features computed, in a worker thread:
# the depth check, the prompt estimate and the canonical prompt text are Python passes over
# every message (~0.25 s for 7 MB of 200,000 short messages), which would hold the event loop
# -- every other request -- for their whole run; in a thread they yield the GIL to the loop
# every switch interval (5 ms). orjson's parse itself is one C call that keeps the GIL either
# way (~10 ns per byte of small objects: the `server.max_body_bytes` limit bounds it). Below
# the threshold the work takes a few milliseconds, less than handing it to a thread is worth.
OFF_LOOP_BYTES = 128 * 1024
# Large bodies prepared at once: their parsed objects take ~20x the bytes (7 MB of short
# messages: ~150 MB), and threads holding the GIL in turn finish no sooner together than one
# after the other. Two keep one ready while the other runs.
OFF_LOOP_AT_ONCE = 2


class OffLoop:
    """At most `at_once` calls running in worker threads. A slot is held until its thread
    ends, not until its caller stops waiting: a cancelled request (client gone, shutdown)
    cannot stop the thread, which keeps its memory until it returns."""

    def __init__(self, at_once: int) -> None:
        self._slots = asyncio.Semaphore(at_once)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        await self._slots.acquire()
        try:
            work = asyncio.get_running_loop().run_in_executor(None, fn, *args)
        except BaseException:
            self._slots.release()
            raise
        work.add_done_callback(lambda _: self._slots.release())
        # shielded: a cancelled caller leaves `work` running (its result, or error, dropped)
        return await asyncio.shield(work)


class Preparer:
    def __init__(
        self, pools: Pools, router: Router, metrics: GatewayMetrics,
        clock: Callable[[], float], gate: TenantGate, responses: ResponseStore,
        expected_output: int = 0,
    ) -> None:
        self.planner = Planner(pools, router.config, gate, router)
        # the output a request without max_tokens is reserved at TPM admission (as flow
        # control charges it: `flow.expected_output_tokens`)
        self._expected = expected_output
        self._router = router
        self._metrics = metrics
        self._clock = clock
        self._gate = gate
        self._responses = responses
        responses.owner = gate.owner  # stored responses are their tenant's incarnation's
        self.sharing: PrefixSharing | None = None  # `kvgate doctor`'s sampled probe
        self.flow: FlowGate | None = None  # flow control's admission queue (gateway/flow/gate.py)
        self._off_loop = OffLoop(OFF_LOOP_AT_ONCE)

    def authenticate(self, token: str | None) -> Principal:
        """The caller (401 `AuthError` for a missing, unknown or revoked key)."""
        return self._gate.principal(token)

    async def before_body(
        self, req: ProxiedRequest, principal: Principal, declared: int | None
    ) -> None:
        """A body declared at `OFF_LOOP_BYTES` or more is refused (429) before it is read
        when its tenant is over a limit now, so a client over its limits cannot keep the
        worker threads (`OffLoop`) busy with bodies that are refused anyway."""
        if declared is not None and declared >= OFF_LOOP_BYTES:
            await self._refuse_early(req, principal)

    async def _refuse_early(self, req: ProxiedRequest, principal: Principal) -> None:
        req.peeked = True
        self._admitted(req, await self._gate.peek(principal))

    def _admitted(self, req: ProxiedRequest, adm: Admission | None) -> None:
        """The x-ratelimit-* headers of an admission on the request; 429 when refused."""
        if adm is None:
            return
        req.extra = rate_limit_headers(adm)
        if not adm.allowed:
            self._metrics.rejected(req.tier, req.tenant, adm.reason or "rpm")
            raise adm.error()

    def identify(self, req: ProxiedRequest, token: str | None) -> Principal:
        """The caller (401 before any body is read); its labels go on the request."""
        gate = self._gate
        principal = gate.principal(token)
        req.tier, req.tenant = principal.tier, gate.labels(principal.tenant_id)
        req.tenant_id, req.key_hash = principal.tenant_id, gate.key_hash(token)
        return principal

    async def prepare(
        self, req: ProxiedRequest, principal: Principal, body: bytes,
        subset: Collection[str] | None = None,
        gone: Callable[[], Awaitable[object]] | None = None,
    ) -> tuple[Decision, bytes]:
        """Parse, admit, plan, rewrite and pick: the decision and the upstream body.
        ``gone`` returns when the client has left (flow control drops it from its queue)."""
        if len(body) >= OFF_LOOP_BYTES and not req.peeked:  # a chunked body: known only now
            await self._refuse_early(req, principal)
        if req.form is not None:  # an audio route's form (`gateway.multipart`)
            req.form, parsed = parse_form(body, req.form.content_type)  # (400s: not a form)
            req.parsed = parsed
        else:
            parsed = req.parsed = await self.parse(body, req.kind, principal)
        adm = await self._gate.admit(principal, self._reserve(parsed, req.kind, principal))
        self._admitted(req, adm)
        req.adm = adm
        counted = self.flow is not None or (adm is not None and adm.limit_tokens)
        if parsed.stream and counted:
            req.streamed = 0  # its output is counted as it goes out (`spent_tokens`)
        if req.kind == "responses":
            await self._previous(parsed)
        plan, held = None, False
        if self.flow is not None:  # flow control: may wait in its pool queue (gateway/flow)
            plan = await self.flow.admit(req, principal, parsed, gone)
        elif self._router.defers:  # several gateways: a contested pick may wait its rank
            plan = await self._hold(req, principal, parsed, gone)
            held = plan is None
        if req.queued_s is not None:  # it waited: sent on the credentials in force now
            principal = self._gate.current(principal, req.key_hash)
        return self._plan_and_pick(req, principal, parsed, subset, plan, held)

    async def _previous(self, parsed: ParsedBody) -> None:
        """A follow-up's ``previous_response_id`` looked up where this gateway does not know
        it (relayed by another gateway: Redis). With authentication, an id found nowhere is
        a 404 as GET answers it, and one Redis could not be asked about a 503 to retry: sent
        on as unknown, it reached whichever replica was picked, and vLLM's store, keyed by
        id alone, continued another tenant's conversation when it held that id. Whose a
        known id is, `_response_home` checks. Without authentication (one tenant) an id
        found nowhere else is asked of the replicas (`ResponseStore.finder`), and one none
        holds is sent on: the replica's 404 answers it."""
        prev = parsed.data.get("previous_response_id")
        if not isinstance(prev, str):  # (none; or not a string: the replica's 400)
            return
        try:
            await self._responses.fetch(prev)
        except ResponseLookupFailed:
            if self._gate.auth:
                raise
            return
        if self._gate.auth and not self._responses.known(prev):
            raise NotFound(f"Response with id '{shown_name(prev)}' not found.",
                           param="previous_response_id")

    async def _hold(
        self, req: ProxiedRequest, principal: Principal, parsed: ParsedBody,
        gone: Callable[[], Awaitable[object]] | None,
    ) -> Plan | None:
        """Wait as long as the router asks before its pick (`Router.defer_s`: a pick among
        several equally good replicas, made once the lower-ranked gateways' picks of the same
        instant have reached this one). The wait counts in the request's queue time; a client
        that leaves meanwhile is let go (499, its admission settled like any other). Returns
        the plan to pick on when it did not wait (planned once), None when it waited (the
        replicas' views are planned again after it)."""
        now = self._clock()
        plan = self.planner.plan(principal, parsed, req.kind, now)
        wait = self._router.defer_s(plan.features, plan.views, now)
        if wait <= 0.0:
            return plan
        self._router.holding(now + wait)  # peers' records are read at once meanwhile
        t0 = perf_counter()
        waits: list[asyncio.Future[object]] = [asyncio.ensure_future(asyncio.sleep(wait))]
        if gone is not None:
            waits.append(asyncio.ensure_future(gone()))
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            req.queued_s = perf_counter() - t0
        if waits[0] not in done:  # the client left
            raise asyncio.CancelledError
        return None

    def _reserve(self, parsed: ParsedBody, kind: str, principal: Principal) -> int:
        """The tokens TPM admission reserves: the prompt and ``n`` times the output asked
        for (an embedding has none), the output at most what fits beside the prompt in the
        model's context where it is known (`Planner.context_len`: a ``max_tokens`` of
        100000 on a 4096-token model reserved 100000, and the tenant's next requests were
        refused while it ran), settled with the real usage when the request ends. Nothing
        for a tenant without a TPM limit: nothing reads it there, and the context lookup
        cost every request of such a tenant."""
        if principal.limits.tpm is None:
            return 0
        expected = 0 if kind == "embeddings" else self._expected
        context = self.planner.context_len(principal, parsed.model)
        return int(asked_tokens(parsed, parsed.prompt_tokens, expected, context))

    async def parse(self, body: bytes, kind: str, principal: Principal) -> ParsedBody:
        """The body parsed (400 `BadRequest` when it is not what kvgate needs): a large one,
        with its prefix features, in a worker thread (`OffLoop`; route explain's too)."""
        if len(body) < OFF_LOOP_BYTES:
            parsed = parse_body(body, kind, lambda: self.planner.default_model(principal))
            adapt(parsed, kind)  # (vLLM's own routes: their prompt, output and stream)
            return parsed
        return await self._off_loop.run(self._digest, body, kind, principal)

    def _digest(self, body: bytes, kind: str, principal: Principal) -> ParsedBody:
        """Parse a large body and compute its prefix features (run in a worker thread)."""
        parsed = parse_body(body, kind, lambda: self.planner.default_model(principal))
        adapt(parsed, kind)
        if kind in PREFIX_KINDS:
            parsed.prefix = self.planner.prefix_features(parsed, principal, kind=kind)
        return parsed

    def _plan_and_pick(
        self, req: ProxiedRequest, principal: Principal, parsed: ParsedBody,
        subset: Collection[str] | None, plan: Plan | None = None, held: bool = False,
    ) -> tuple[Decision, bytes]:
        now = self._clock()
        plan = plan or self.planner.plan(principal, parsed, req.kind, now)
        pool = req.pool = plan.pool
        req.pool_name, req.features, req.spilled = pool.name, plan.features, plan.spilled
        gate = self._gate
        kind = req.kind  # the salt and priority only where vLLM's request has the field
        if req.form is not None:
            upstream_body = req.form.rewrite(plan.served, gate.client_salt, gate.client_priority)
        else:
            upstream_body, req.strip = rewrite_body(
                parsed, kind, plan.served, cache_salt=gate.salt(principal) if kind in SALTED
                else None, priority=plan.priority if kind in PRIORITIZED else None,
                client_salt=gate.client_salt, client_priority=gate.client_priority,
            )
        if plan.spilled:
            self._metrics.spilled(principal.tier, plan.home, pool.name)
        views = plan.views
        # the replicas the request may use: all, a LoRA adapter's, or the data plane's subset
        among = plan.among
        if subset is not None:
            views = [v for v in views if v.id in subset]
            among = [r for r in (among or pool.replicas) if r.id in subset]
            if not views:  # (nothing of ours to wait for: Retry-After 1, as `retry_after`)
                raise NoReplicaAvailable("None of the endpoints allowed for this request "
                                         f"serves the model `{parsed.model}`.",
                                         retry_after=pool.retry_after(now, among))
        home = self._response_home(req, parsed) if req.kind == "responses" else None
        if home is not None and (subset is None or home in subset):
            return Decision(home, (), "response-affinity"), upstream_body
        decision = self._pick(plan.features, views, now, held, pool)
        if decision is None:
            raise pool.none_healthy(parsed.model, now, among)
        if self.sharing is not None:
            self.sharing.observe(pool.name, decision.replica, plan.features)
        if self.flow is not None:  # the pick counts in its pool; route "queued" if it waited
            decision = self.flow.mark(req, decision)
        parsed.shed()  # everything above has read it; the upstream body is written
        return decision, upstream_body

    def _pick(self, features: RequestFeatures, views: list[ReplicaView], now: float, held: bool,
              pool: Pool) -> Decision | None:
        """The router's pick, widened twice before giving up (None): first every available
        replica only backing off after busy 503s counts as healthy (tried rather than a 503
        without asking), then also replicas on trial whose trial streams answer (rather than a
        503 until the longest of those streams ends, `Replica.trial_answering`)."""
        for widen in _WIDENINGS:
            if widen is not None:
                views = [_healthy(v) if not v.healthy and widen(pool, v, now) else v
                         for v in views]
            try:
                return self._router.pick(features, views, now, held=held)
            except NoCandidate:
                continue
        return None

    def _response_home(self, req: ProxiedRequest, parsed: ParsedBody) -> str | None:
        """The replica holding `previous_response_id`, when this gateway relayed it (404 when
        it relayed it for another tenant)."""
        prev = parsed.data.get("previous_response_id")
        if not isinstance(prev, str):
            return None
        if self._responses.foreign(prev, req.tenant_id):  # answered as GET answers it
            raise NotFound(f"Response with id '{prev}' not found.", param="previous_response_id")
        home = self._responses.home(prev, req.tenant_id)
        if home is None or home.pool != req.pool.name or home.replica not in req.pool.by_id:
            return None
        out = home_out(req.pool, req.pool.by_id[home.replica], prev, self._clock(), True)
        if out is not None:  # (no other replica holds it: a 503 to retry, not a wait there)
            raise out
        return home.replica

    async def settle_before_answer(self, req: ProxiedRequest) -> None:
        """Settle the admission before a whole answer goes out (`finish` then only releases):
        a client sending its next request the moment it has this one's answer finds the
        bucket settled. A ``max_tokens`` far above its tenant's TPM, reserved at admission,
        made that next request a 429 for the moments until `finish` settled it (after a 400
        for a context too long, or a short answer)."""
        if req.adm is not None and (tokens := req.settle_tokens()) is not None:
            served = not unserved(req)
            await self._gate.settle(req.adm, tokens if served else 0, served=served)
            req.settled_headers(served)

    async def finish(self, req: ProxiedRequest, log: logging.Logger) -> None:
        """The request is over (answered, failed or abandoned): metrics, the request line,
        and the admission settled with the real usage."""
        total = perf_counter() - req.t0
        if req.flow_done is not None:  # its tenant's share of the pool (gateway/flow/gate.py)
            req.flow_done()
            req.flow_done = None
        self._metrics.finished(
            req.pool_name, req.replica, req.status, req.route, total, req.tier, req.tenant,
            req.kind,
        )
        if log.isEnabledFor(logging.INFO):
            log_request(log, req, total)
        if req.adm is not None:
            served = not unserved(req)
            tokens = req.settle_tokens() if served else 0
            await self._gate.finish(req.adm, tokens, served=served)


# What a request answered so, nothing of it sent, was never served: no replica could take it
# (503: none healthy, a pool's queue full, shutdown; 429: its pool's queue shed it past its
# tier's longest wait or displaced it -- an admission's own 429 settles nothing; 499: its
# client left that queue) or its replicas failed before any output (502), or kvgate cut it
# before any output (504: a first-byte, stall or total timeout on its last try; behind Envoy
# on its only try, as the picker cannot send it again). The client got nothing and its SDK
# sends it again: the HTTP edge retrying a cut try on another replica charges the request
# once, and so does the client's retry of a 504 now (each was a request of the RPM before).
# A replica's 500 served it (an exception serving it); another 4xx is the client's.
_UNSERVED = frozenset({429, 502, 503, 504})


def unserved(req: ProxiedRequest) -> bool:
    """Whether `req` was never served: its admission gives back the request (RPM) and all of
    its tokens (TPM: the prompt too, not `ProxiedRequest.settle_tokens`'s estimate).
    Charged, an outage of a few minutes spent the budget of every tenant that kept asking,
    and the first minute after it was refused 429 for requests nobody answered."""
    if req.status == 499 and req.queued_s is not None and req.replica == "none":
        return True  # its client left flow control's queue (an SDK's timeout, retried)
    return (req.status in _UNSERVED and req.used is None and req.ttft is None
            and not req.relayed)


def _healthy(view: ReplicaView) -> ReplicaView:
    return replace(view, healthy=True)


def _backing_off(pool: Pool, view: ReplicaView, now: float) -> bool:
    return bool((r := pool.by_id.get(view.id)) and r.available(now))


def _trial_answering(pool: Pool, view: ReplicaView, now: float) -> bool:
    return bool((r := pool.by_id.get(view.id)) and r.trial_answering(now))


# `Preparer._pick`'s tries: as the router sees the views, then each widening in turn
_WIDENINGS: tuple[Callable[[Pool, ReplicaView, float], bool] | None, ...] = (
    None, _backing_off, _trial_answering)
