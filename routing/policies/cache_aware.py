"""`cache_aware` (default): send the request where its estimated time to first token is lowest.

For each healthy candidate r (all terms in prompt tokens unless noted):

    queued_r   = kvgate's pending uncached prefill work on r (drained at r's learned rate since
                 it was sent, as r's whole queue drains: the work other gateways sent there
                 joins it, `PendingWork.arrived`), its own plus other gateways' (shared
                 state, published undrained: only the part the request's own prefix waits
                 for drains, `_waited_for`, or, while the replicas' scraped queues overload
                 the fleet, all of it with ours, `_overloaded`; capped by the fleet's
                 in-flight prompt tokens) +
                 requests the scrape shows waiting beyond kvgate's own x the mean request
                 size (only when the scrape is fresh)
    decode_r   = requests decoding on r x decode_weight_tokens (chunked prefill shares steps)
    uncached_r = prompt tokens - tokens of r's predicted prefix match (affinity index)
    full_r     = min(1, (blocks r's cache holds + the copy's) / r's capacity)
    claim_r    = for a prompt no replica holds any of, while some candidate's cache holds
                 nothing: fill_r / (the mean fill + the copy's share of r), fills = blocks
                 held / capacity; else 0
    cost_r     = fixed_r + (queued_r + decode_r
                 + uncached_r x (1 + (miss_weight - 1) x min(1, max(full_r, claim_r)))) x spt_r
                 + kv_penalty_r                                                            [s]
    kv_penalty = kv_penalty_s x ((kv_usage - kv_knee) / (1 - kv_knee))^2  above the knee

``fixed_r`` and ``spt_r`` (seconds per token) are r's learned TTFT model
(`routing.learning.TtftModel`). With ``miss_weight`` = 1 the cost is the request's own TTFT
estimate. A miss costs the fleet more than that request's wait: the copy of the prefix takes KV
memory that, in a full cache, evicts another prefix (a later miss). ``miss_weight`` > 1 charges
it, as much as r's cache is full. While caches have room a copy evicts nothing, but a new
prefix (a prompt no replica holds any of: a new tenant's system prompt, a new agent's tool
prompt, a new document) claims r for every request that will share it. Placed beside another
tenant's prefix, both tenants' traffic must come back to r, until the load bound refuses r
and their prompts are recomputed elsewhere (the synthetic workload's TTFT tail); placed on an
empty cache, it competes with nothing. So while some candidate's cache holds nothing (a fleet
warming up, a replica just started), a new prefix pays for r's fill against the mean
(``claim_r``), whatever small differences the learned fits or the tie hash show. A request
extending a held prefix (a new session on a tool prompt, a conversation's next turn) adds to
a prefix that already has its home (new sessions: the ramp below). Once every cache holds
something the fills measure history (at large KV sizes, contexts long finished), not what
will come back: the eviction price alone, as before.

The minimum wins among the replicas the bounded-load rule admits; costs under ``tie_quantum_s``
tie, and above it costs in the same step of a log scale of ratio 1 + ``tie_relative`` from
there (two costs 1 % apart across a step's edge do not tie); ties go to the replica with fewer
requests in flight, then to a stable hash of (prompt, replica), so identical requests spread by
a fixed per-prompt order, never by the order views arrive in. Several gateways blind to each
other's latest picks break ties by the hash alone (in-flight counts a sync window old would
send them all to one replica) and take turns among the candidates about as cheap as the
cheapest that hold the longest prefix of them (`PickContext.turn`), or, when the gateway holds
such a contested pick until the lower ranks' have reached it (`contested`,
`Router.defer_s`), pick it knowing them, without turns; from a gateway's second
pick within the sync window (a burst), each replica's TTFT fit counts only half-way from the
fleet's (`_in_burst`).

A request opening a new context (an agent session, a conversation: its longest match ends on
no earlier request's prompt, `routing.policies.sessions`) commits the calls that follow it to
its replica, which the load bound sees only as they arrive. On a replica whose foreseen load
is above the pool mean it is charged up to ``session_ramp_tokens`` of prefill at r's rate,
rising from the mean to ``session_ramp_factor`` x mean + ``session_ramp_slack``, while the
pool's mean live contexts are at least ``session_ramp_min_mean``: new sessions spread before
their holder reaches the bound, which would refuse the sessions' next calls (each recomputing
its whole context elsewhere). The foreseen load is counted as the bound counts, in requests in
flight: the larger of r's in flight now and its live contexts (ones calling back every few
seconds) x the share of live contexts that did come back (`_ramp`). Continued contexts are
never charged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import log as _log
from math import log1p as _log1p
from operator import itemgetter

from routing.learning import TtftFit
from routing.load import bound_limit
from routing.policies.base import PeerComputing, PickContext, RouterState, decide
from routing.policies.sessions import Sessions
from routing.types import Candidate, Decision, ReplicaView

__all__ = ["CacheAware"]

_MASK64 = (1 << 64) - 1
# several gateways: candidates within this share of the cheapest cost, plus this many mean
# requests' prefill, count as equally good, and the gateways take turns over them
_TURN_RELATIVE = 0.1
_TURN_MEAN_REQUESTS = 0.5

# several gateways: while the fleet's scraped waiting requests (mean requests) per replica
# would take longer than this to prefill at the fleet's rate, the peers' pending work drains
# in the cost as our own does (`_overloaded`)
_OVERLOAD_S = 0.25

# the highest cost a candidate is given (seconds): a scraped count no engine could hold (1e306
# requests waiting) made its cost infinite, and a pick of the pool raised OverflowError (every
# request a 500); such a replica is ranked last instead
_MAX_COST_S = 1e12

# per candidate: (cost quantum, tie rank, cost s, view, matched blocks, queued, decode tokens,
# uncached, TTFT fit as learned, kv usage, fleet-wide in-flight requests)
_Row = tuple[int, int, float, ReplicaView, int, float, float, float, TtftFit, float, int]


class CacheAware:
    name = "cache_aware"
    reads_peer_loads = True  # `PickContext.peer_loads`: other gateways' load, beside the views

    def __init__(self, state: RouterState) -> None:
        self._state = state
        self._sessions = Sessions(state.config.session_window_s)
        # another gateway routed a chain (`Router.apply_peer_routes`): its contexts count too
        self.peer_routed = self._sessions.peer_routed
        # where a request really went (`Router.record_route`): a retry moves its context
        self.routed = self._sessions.routed

    def _rows(self, ctx: PickContext) -> tuple[list[_Row], int, int]:
        """The candidates' rows, the longest match among them (blocks) and their in-flight
        requests summed (fleet-wide): what `_admitted` needs besides, counted in the loop."""
        # One tight loop run for every candidate of every request (the decision budget is
        # 50 us at 16 replicas), so lookups are hoisted and terms inlined, not helper calls.
        st, cfg, f = self._state, self._state.config, ctx.features
        matched = st.index.match(f.block_hashes) if f.block_hashes else {}
        mget = matched.get
        prompt, tpb, key, quantum, per_step = (
            f.prompt_tokens,
            cfg.tokens_per_block,
            ctx.tie_key,
            cfg.tie_quantum_s,
            _log1p(cfg.tie_relative),
        )
        stale, knee, kv_penalty_s, dw, mean_req = (
            cfg.stale_after_s,
            cfg.kv_knee,
            cfg.kv_penalty_s,
            cfg.decode_weight_tokens,
            st.pending.mean_request_tokens,
        )
        pget = st.pending.records().get
        fget, fleet, hashes = st.ttft.fits().get, st.ttft.fleet, st.replica_hashes
        half, fleet_fixed, fleet_spt = _in_burst(ctx), fleet.fixed_s, fleet.s_per_token
        rows: list[_Row] = []
        dup = cfg.miss_weight - 1.0
        # each cache's fill (blocks held / capacity), their mean and least: a prompt no
        # replica holds any of claims r while a cache is empty (module docstring)
        ids = [v.id for v in ctx.views]
        fills, capacities = st.index.fills(ids)
        mean_fill, least_fill = sum(fills) / len(fills), min(fills)
        longest = total = 0  # the longest match, the in-flight requests summed
        # (no candidate matches anything: `match` omits the replicas matching nothing)
        claims = least_fill == 0.0 and matched.keys().isdisjoint(ids)
        peers = ctx.peer_loads.get if ctx.peer_loads else None
        computing, now, want = ctx.peer_computing.get, ctx.now, f.block_hashes
        drain = peers is not None and _overloaded(ctx.views, stale, mean_req * fleet_spt)
        second = -1  # the second longest match among the candidates (< 0: not yet)
        # a cold model (`RouterConfig.cold_observations`): queues are at least what the
        # engines say waits there (module docstring)
        cold = st.ttft.observations < cfg.cold_observations * len(ctx.views)
        for v, vfill, vcap in zip(ctx.views, fills, capacities, strict=True):
            vid, inflight = v.id, v.inflight
            gateway, gateway_reqs, peer = (
                v.inflight_prefill_tokens, v.inflight_prefill, v.peer_prefill_work)
            if peers is not None and (q := peers(vid)) is not None:
                # other gateways' in-flight work (shared state): the fleet's
                inflight += q.inflight
                gateway += q.prefill_tokens
                gateway_reqs += q.prefill
                peer += q.pending_work
            total += inflight
            m = mget(vid, 0)
            if m > longest:
                longest = m
            cached = m * tpb
            if cached >= prompt:
                cached = prompt - 1 if prompt > 0 else 0
            uncached = float(prompt - cached)
            # queued: our predicted uncached work, capped by the gateway's raw count; the
            # gateway's count alone when we hold no record (e.g. routed before a restart)
            p = pget(vid)
            fit = fget(vid, fleet)
            fixed, spt = fit.fixed_s, fit.s_per_token
            if half:  # `_in_burst`: half-way to the fleet's fit (`_costed`, inlined)
                fixed, spt = (fixed + fleet_fixed) * 0.5, (spt + fleet_spt) * 0.5
            # (what is left of r's queue, ours and the peers' joined, up to our part of it)
            own, own_reqs = (0.0, 0) if p is None else (
                p.fluid_left(now, 1.0 / spt) if inflight > 0 else 0.0, p.count)
            if peer > 0.0:  # other gateways' predicted work (shared state)
                # ...only where r alone holds that prefix: elsewhere it is held too, and
                # waiting for a peer's long prefill is not the price of avoiding a copy
                if m and (c := computing(vid)):
                    if second < 0:  # the second longest match of all candidates, once
                        second = sorted([0, *[mget(o.id, 0) for o in ctx.views]])[-2]
                    if m > second:  # no other candidate matches as much as r
                        peer -= _waited_for(c, want, m, now, spt, cached)
                if peer > 0.0:
                    if drain and p is not None and inflight > 0:
                        # the fleet overloaded: what is left of r's joined queue, theirs too
                        own = p.fluid_left(now, 1.0 / spt, peer)
                    else:
                        own += peer
                own_reqs += 1
            if gateway > 0 and (own > gateway or not own_reqs):
                own = float(gateway)
            own_reqs = gateway_reqs or own_reqs
            decoding = float(inflight - own_reqs if inflight > own_reqs else 0)
            kv = penalty = 0.0
            if v.scrape_age_s is not None and v.scrape_age_s <= stale:  # else fail open
                if v.waiting:
                    if v.waiting > own_reqs:
                        own += (v.waiting - own_reqs) * mean_req
                    if cold:  # (less what it prefilled since the scrape)
                        floor = v.waiting * mean_req - v.scrape_age_s / spt
                        if own < floor:
                            own = floor
                if v.running is not None and v.running > decoding:
                    decoding = v.running
                kv = v.kv_usage or 0.0
                if kv > knee:
                    x = (kv - knee) / (1.0 - knee)
                    penalty = kv_penalty_s * (x * x if x < 1.0 else 1.0)
            decode = decoding * dw
            # the copy's price beyond its own prefill: what it evicts (how full r's cache is)
            # or, for a new prefix while a cache is empty, its claim on r (r's fill against
            # the mean), whichever is more
            copy = uncached / tpb / vcap
            full = vfill + copy
            if claims and copy > 0.0:  # (an empty prompt copies nothing)
                share = vfill / (mean_fill + copy)
                if share > full:
                    full = share
            if full > 1.0:  # (min(full, 1.0) without the call: the same for NaN)
                full = 1.0
            cost = (fixed + (own + decode + uncached * (1.0 + dup * full)) * spt + penalty)
            if not cost < _MAX_COST_S:  # (infinite, or NaN: inf - inf)
                cost = _MAX_COST_S
            z = ((key ^ hashes[vid]) * 0x9E3779B97F4A7C15) & _MASK64  # = routing.load.mix
            z ^= z >> 29
            step = int(_log(cost / quantum) / per_step) if cost > quantum else 0
            rows.append((step, z, cost, v, m, own, decode, uncached, fit, kv, inflight))
        return rows, longest, total

    def _admitted(
        self, ctx: PickContext, key: Callable[[_Row], tuple[int, ...]]
    ) -> tuple[list[_Row], int | None, float, list[_Row], int]:
        """The candidates' rows (the ramp charged to a new context) sorted by ``key``, the
        tail this request continues (`Sessions.continued`), the load bound's limit, the
        rows within it and the longest match among them (blocks)."""
        cfg = self._state.config
        rows, longest, total = self._rows(ctx)
        hashes = ctx.features.block_hashes
        previous = self._sessions.continued(hashes, min(longest, len(hashes)))
        if previous is None and cfg.session_ramp_tokens > 0.0:
            rows = self._ramp(ctx, rows)
        rows.sort(key=key)
        extra, left_out = ctx.left_out
        limit = bound_limit(total + extra, len(rows) + left_out,
                            cfg.load_factor, cfg.load_slack) + 1e-9
        return rows, previous, limit, [r for r in rows if r[10] <= limit], longest

    def choose(self, ctx: PickContext) -> Decision:
        # one gateway: a tie goes to fewer in flight; several: in-flight counts a sync window
        # old would send every gateway to the same replica (the hash spreads them, and turns)
        rows, previous, limit, admitted, longest = self._admitted(
            ctx, _rank if ctx.gateways == 1 else _hashed)
        hashes = ctx.features.block_hashes
        # the bound refused the cheapest (a turn among near-equals is no overflow)
        overflow = not admitted or admitted[0] is not rows[0]
        if ctx.turn_order is not None and len(admitted) > 1:
            admitted = self._take_turns(ctx, admitted)
        ordered = admitted + [r for r in rows if r[10] > limit]
        chosen = ordered[0]
        if overflow:
            reason = "overflow"
        elif chosen[4] > 0 and chosen[4] >= longest:
            reason = "prefix-hit"
        else:
            reason = "least-cost"
        ranked = self._explain(ctx, ordered, limit) if ctx.explain else ()
        if not ctx.explain:
            self._sessions.record(hashes, chosen[3].id, ctx.now, previous)
        return decide([r[3].id for r in ordered], reason, ranked)

    def _ramp(self, ctx: PickContext, rows: list[_Row]) -> list[_Row]:
        """A new context commits the calls that will follow it to its replica: on a replica
        whose foreseen load is above the pool mean, charge it up to ``session_ramp_tokens``
        of prefill, in full at ``session_ramp_factor`` x mean + ``session_ramp_slack``, so
        that new sessions spread before their holder reaches the load bound (which would
        then refuse the sessions' next calls, each recomputing its whole context elsewhere).

        The foreseen load is in the bound's own units, requests in flight: once r's live
        contexts call again, r has at least as many in flight as it has now, and at least one
        call of each live context that will come back (its live contexts x the share of live
        contexts that came back, `Sessions.returning`). Neither alone: live contexts alone
        sent new conversations to holders with fewer of them and more requests in flight
        (a big tenant's one-off conversations, `routing/README.md`), which then refused
        their next turns; in-flight requests alone miss the sessions between calls."""
        cfg = self._state.config
        live = self._sessions.live(ctx.now)
        if not live:
            return rows
        returning, n = self._sessions.returning, len(rows)
        if returning * sum(live.values()) / n < cfg.session_ramp_min_mean:
            return rows
        foreseen = [max(float(r[10]), returning * live.get(r[3].id, 0)) for r in rows]
        mean = sum(foreseen) / n
        span = (cfg.session_ramp_factor - 1.0) * mean + cfg.session_ramp_slack
        half, fleet = _in_burst(ctx), self._state.ttft.fleet
        quantum, per_step = cfg.tie_quantum_s, _log1p(cfg.tie_relative)
        out = []
        for row, load in zip(rows, foreseen, strict=True):
            over = load - mean
            if over > 0.0:
                cost = min(row[2] + cfg.session_ramp_tokens * min(1.0, over / span) * (
                    _costed(row[8], fleet, half).s_per_token), _MAX_COST_S)
                step = int(_log(cost / quantum) / per_step) if cost > quantum else 0
                row = (step, row[1], cost, *row[3:])
            out.append(row)
        return out

    def contested(self, ctx: PickContext) -> int:
        """Over how many candidates this pick would take a turn (0: none): the admitted ones
        about as cheap as the cheapest that hold the longest prefix of them (`_take_turns`),
        the replicas peers blind to it could stack their picks of the same instant on
        (`Router.defer_s`). A pick for its prefix's holder (one such candidate, a
        conversation's next turn) takes none. Reads the state; changes nothing a pick reads."""
        admitted = self._admitted(ctx, _hashed)[3]
        if len(admitted) < 2:
            return 0
        near = len(self._near(admitted)[2])
        return near if near > 1 else 0

    def _near(self, admitted: list[_Row]) -> tuple[list[_Row], int, dict[str, _Row]]:
        """The admitted candidates about as cheap as the cheapest, the longest prefix any of
        them holds, and those of them holding it (by replica id)."""
        st = self._state
        margin = _TURN_MEAN_REQUESTS * st.pending.mean_request_tokens * st.ttft.fleet.s_per_token
        good = admitted[0][2] * (1.0 + _TURN_RELATIVE) + margin
        close = [r for r in admitted if r[2] <= good]
        longest = max(close, key=_matched)[4]
        return close, longest, {r[3].id: r for r in close if r[4] == longest}

    def _take_turns(self, ctx: PickContext, admitted: list[_Row]) -> list[_Row]:
        """Several gateways: among the admitted candidates about as cheap as the cheapest and
        holding the longest prefix of those, the one whose turn it is in the order all
        gateways agree on (`Turns.turn`), so that gateways blind to each other's latest
        picks do not all take the same replica. A turn never gives up a predicted hit: a
        conversation's next turn stays on its holder when others are about as cheap."""
        close, longest, near = self._near(admitted)
        if len(near) == 1:  # the one whatever the order
            if close[0][4] == longest:  # the cheapest: the order stands
                return admitted
            (chosen,) = near.values()
            return [chosen] + [x for x in admitted if x is not chosen]
        assert ctx.turn_order is not None
        order = ctx.turn_order()
        for i in range(len(order)):
            r = near.get(order[(ctx.turn + i) % len(order)])
            if r is not None:
                return [r] + [x for x in admitted if x is not r]
        return admitted  # pragma: no cover - `near` is never empty

    def _explain(self, ctx: PickContext, rows: list[_Row], limit: float) -> tuple[Candidate, ...]:
        tpb = self._state.config.tokens_per_block
        half, fleet = _in_burst(ctx), self._state.ttft.fleet
        low = max(min(r[2] for r in rows), 1e-9)
        out = []
        for _, _, cost, v, m, queued, decode, uncached, fit, kv, inflight in rows:
            fit = _costed(fit, fleet, half)
            terms = {
                "matched_tokens": float(m * tpb),
                "uncached_tokens": uncached,
                "queued_tokens": queued,
                "decode_tokens": decode,
                "prefill_tps": fit.rate,
                "fixed_s": fit.fixed_s,
                "kv_usage": kv,
                "inflight": float(inflight),
                "admitted": 1.0 if inflight <= limit else 0.0,
                "score": min(1.0, low / max(cost, 1e-9)),  # [0, 1], higher is better
            }
            out.append(Candidate(v.id, cost, terms))
        return tuple(out)


def _in_burst(ctx: PickContext) -> bool:
    """Whether this pick costs with every replica's TTFT fit half-way to the fleet's: several
    gateways share state and this is the gateway's second pick or later within the sync
    window (a burst).

    The fits differ between replicas, and every gateway learns the same differences (the
    same scraped counters): within a burst, blind to each other's picks, all of them lean
    towards the replicas that look fastest. One gateway sees its own picks queue there and
    moves on; four stack their picks before any record arrives (bursts, 4 gateways, 10 ms:
    a replica's work in a burst up to 3x the mean where one gateway has 2x). Without the
    per-replica differences at all the tail halves but the median loses what the
    differences are worth (one gateway's p50 +8 %); half of them keeps the median.
    (docs/shared-state-measurements.md, "Bursts")"""
    return ctx.gateways > 1 and ctx.turn >= ctx.gateways


def _overloaded(views: Sequence[ReplicaView], stale_s: float, mean_request_s: float) -> bool:
    """Whether the replicas' scraped waiting requests, each a mean request's prefill at the
    fleet's rate, are more than `_OVERLOAD_S` of work per replica (fresh scrapes only).

    Several gateways: away from overload the peers' pending work counts as published,
    undrained until its first token (drained, it made holders look free: agent sessions and
    rag-corpus's medians at 1,048,576, heavy-tail's tail); under a sustained overload that
    overstates every queue the peers feed, and each gateway piles onto the replicas holding
    its own backlog (load-ramp at 262,144: docs/shared-state-measurements.md)."""
    waiting = 0.0
    for v in views:
        if v.waiting and v.scrape_age_s is not None and v.scrape_age_s <= stale_s:
            waiting += v.waiting
    return waiting * mean_request_s > _OVERLOAD_S * len(views)


def _costed(fit: TtftFit, fleet: TtftFit, half: bool) -> TtftFit:
    """The fit a pick costs with (`_in_burst`: half-way to the fleet's; `_rows` inlines it)."""
    if not half:
        return fit
    return TtftFit((fit.fixed_s + fleet.fixed_s) * 0.5, (fit.s_per_token + fleet.s_per_token) * 0.5)


# the sort keys (built in C: a key function in Python was called for every row of every pick)
# one gateway: cost step, fewer in flight, tie hash; several: cost step, tie hash
_rank: Callable[[_Row], tuple[int, ...]] = itemgetter(0, 10, 1)
_hashed: Callable[[_Row], tuple[int, ...]] = itemgetter(0, 1)


_matched = itemgetter(4)


def _waited_for(
    computing: Sequence[PeerComputing], want: Sequence[int], m: int, now: float, spt: float,
    shared: float,
) -> float:
    """How much of a peer's pending work on a replica, published undrained until its first
    token, is already done when it is the prefill this request waits for: the request's
    match there ends in blocks a peer's recent route brought (the holder is computing the
    prefix), done at the replica's rate since that route was applied. Only while it is still
    computing; the rest of the peers' pending work counts in full (draining it all made
    drained-looking holders attract agent sessions: docs/shared-state.md)."""
    for t, chain, held, work in reversed(computing):
        # the match ends inside the peer's chain, past what r held before it: the request
        # shares a prefix the peer's request is computing (one that covers the whole chain
        # continues it: that request has its answer, its work is no longer pending)
        i = m - 1
        if held <= i < len(chain) - 1 and i < len(want) and chain[i] == want[i]:
            done = (now - t) / spt
            if 0.0 < done < work:
                return done if done < shared else shared
            return 0.0
    return 0.0

