"""A pure, deterministic model of one vLLM V1 engine: scheduler + paged KV cache + cost model.

No asyncio, no I/O, no clock: the caller owns time. `advance(until)` runs every engine step that
*starts* before ``until`` (a step's batch is fixed when it starts, so an arrival during a step
joins the next one) and returns what each request produced. Steps made only of decodes, with
nothing able to change until the next finish, block allocation or the horizon, are taken many at
once in closed form (see `fastforward`), which is what makes hour-long offline replays cheap.

Scheduling follows vLLM V1: running requests first (each needs its remaining prefill chunk or one
decode token) under the token budget; when one cannot get KV blocks, the newest running request
(lowest priority first under the priority policy) is preempted for recomputation; then waiting
requests are admitted in order while seats, budget and blocks last (none after a preemption).

Prefix caching follows vLLM V1 too: a request's full prompt blocks are cached when they are
*scheduled*, not when the step computing them ends (V0's rule). `KVCacheManager.allocate_slots`
(`v1/core/kv_cache_manager.py`) caches the full blocks covered by ``computed + new`` tokens right
after allocating them (block hashes depend on token ids only), and the forward pass writes
every scheduled token's KV before attention reads the cache; so a request scheduled later in
the same step, or in a later step while a chunked prefill goes on, hits the blocks being
computed and computes only its uncached suffix. Only prompt blocks are hashed here (vLLM V1
hashes output blocks too; no request of the simulator can share one).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Set as AbstractSet

from loadtest.sim.cache import KVCache
from loadtest.sim.fastforward import plan_fast_forward
from loadtest.sim.spec import EngineConfig, EngineStats, RequestOutput, RequestSpec

__all__ = ["Engine"]

_WAITING, _RUNNING, _DONE = 0, 1, 2


class _Req:
    __slots__ = (
        "admitted_once",
        "cached",
        "cached_tokens",
        "computed",
        "first_token_time",
        "hashes",
        "id",
        "next_reg",
        "num_tokens",
        "output",
        "preemptions",
        "prio_key",
        "private",
        "prompt",
        "reason",
        "scheduled_at",
        "seq",
        "state",
        "target",
    )

    def __init__(self, spec: RequestSpec, seq: int, key: tuple[int, int]) -> None:
        self.id = spec.request_id
        self.hashes = spec.block_hashes
        self.prompt = spec.prompt_tokens
        self.num_tokens = spec.prompt_tokens  # prompt + sampled tokens
        self.computed = 0  # tokens whose KV is in the cache
        self.output = 0
        stop = spec.eos_after if (spec.eos_after is not None and not spec.ignore_eos) else None
        if stop is not None and 1 <= stop <= spec.max_tokens:
            self.target, self.reason = stop, "stop"
        else:
            self.target, self.reason = spec.max_tokens, "length"
        self.seq = seq
        self.prio_key = key
        self.state = _WAITING
        self.cached: list[int] = []  # referenced cached block hashes, in block order
        self.private = 0
        self.next_reg = 0  # next prompt block index to cache once scheduled
        self.cached_tokens = 0
        self.first_token_time: float | None = None
        self.scheduled_at: float | None = None  # first admitted (start of that step)
        self.preemptions = 0
        self.admitted_once = False

    def blocks(self) -> int:
        return len(self.cached) + self.private

    def __lt__(self, other: _Req) -> bool:
        return self.prio_key < other.prio_key


class Engine:
    """One replica's engine in simulated time (seconds, any origin)."""

    def __init__(self, config: EngineConfig, start_time: float = 0.0) -> None:
        self.config = config
        self.now = start_time
        self.cache = KVCache(config.num_gpu_blocks, config.enable_prefix_caching)
        self.stats = EngineStats()
        self._bs = config.block_size
        self._reqs: dict[str, _Req] = {}
        self._running: list[_Req] = []
        self._waiting: list[_Req] = []  # heap by (priority or 0, arrival seq); lazy deletion
        self._num_waiting = 0
        self._seq = 0
        self._outs: dict[str, RequestOutput] = {}
        self._changes = 0  # counts what changes the queue, the batch or the cache (`backlog`)
        self._ahead: tuple[int, int, AbstractSet[int], int, int, int] | None = None

    # -- observation -----------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def kv_usage(self) -> float:
        return self.cache.usage()

    @property
    def busy(self) -> bool:
        return bool(self._running) or self._num_waiting > 0

    def next_event_time(self) -> float | None:
        """When the next step starts (anything observable changes at its end); None when idle."""
        return self.now if self.busy else None

    def has_request(self, request_id: str) -> bool:
        return request_id in self._reqs

    def backlog(self, spec: RequestSpec) -> tuple[int, int, int, int]:
        """What ``spec`` queued now would find when it is scheduled: (its prompt tokens cached
        then, as admission counts them: full blocks, the last prompt token always recomputed;
        prompt tokens still to prefill ahead of it; sequences decoding; context tokens of the
        running sequences).

        The prompt blocks of every request running or queued ahead count as cached, for it and
        for each queued one behind them: blocks are cached when scheduled (V1), and a waiting
        request is admitted only once every prefill ahead of it is scheduled in full (a chunk
        that is not a prompt's last takes the step's whole budget). Evictions and preemptions
        before then are not foreseen."""
        prio = spec.priority if self.config.scheduling_policy == "priority" else 0
        ahead = self._ahead
        if ahead is None or ahead[:2] != (self._changes, prio):
            # the queue's part is the same for every request routed before the engine changes
            # (the oracle asks each engine at each pick: an overloaded replay's long queues
            # were walked in full every time, quadratic in the trace)
            ahead = self._ahead = (self._changes, prio, *self._queued_ahead(prio))
        _, _, pending, prefill, decoding, context = ahead
        cached = self._hits(spec.block_hashes, spec.prompt_tokens, pending)
        return cached, prefill, decoding, context

    def _queued_ahead(self, prio: int) -> tuple[AbstractSet[int], int, int, int]:
        """`backlog`'s part that does not depend on the request: (prompt blocks pending,
        prefill tokens ahead, sequences decoding, context tokens running)."""
        pending: set[int] = set()  # prompt blocks ahead, not cached yet: they will be
        prefill = decoding = context = 0
        for r in self._running:
            left = r.num_tokens - r.computed
            context += r.computed
            if r.output > 0 and left <= 1:
                decoding += 1
            else:
                prefill += left
            pending.update(r.hashes[r.next_reg:])
        ahead = sorted(r for r in self._waiting if r.state == _WAITING and r.prio_key[0] <= prio)
        for r in ahead:
            prefill += r.num_tokens - self._hits(r.hashes, r.num_tokens, pending)
            pending.update(r.hashes)
        return pending, prefill, decoding, context  # (never changed after: `_hits` reads)

    def _hits(self, hashes: tuple[int, ...], tokens: int, pending: AbstractSet[int]) -> int:
        """Prompt tokens of a prompt of ``tokens`` found in the cache or in ``pending``."""
        cache = self.cache
        limit = min(len(hashes), (tokens - 1) // self._bs)
        n = cache.match(hashes, limit)
        if cache.enable_prefix_caching:
            while n < limit and (hashes[n] in pending or cache.contains(hashes[n])):
                n += 1
        return n * self._bs

    # -- requests --------------------------------------------------------------------------
    def add_request(self, spec: RequestSpec, arrival_time: float) -> None:
        """Queue a request that arrived at ``arrival_time`` (call `advance(arrival_time)` first)."""
        if spec.request_id in self._reqs:
            raise ValueError(f"duplicate request id {spec.request_id!r}")
        if spec.max_tokens < 1 or spec.prompt_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be >= 1")
        if spec.prompt_tokens + spec.max_tokens > self.config.max_model_len:
            raise ValueError("prompt_tokens + max_tokens exceeds max_model_len")
        self._seq += 1
        self._changes += 1
        prio = spec.priority if self.config.scheduling_policy == "priority" else 0
        req = _Req(spec, self._seq, (prio, self._seq))
        self._reqs[req.id] = req
        heapq.heappush(self._waiting, req)
        self._num_waiting += 1
        self.stats.received += 1
        self.now = max(self.now, arrival_time)

    def abort(self, request_id: str) -> bool:
        """Drop a request now (client gone); its blocks are freed. False if unknown/finished."""
        req = self._reqs.get(request_id)
        if req is None:
            return False
        self._changes += 1
        if req.state == _WAITING:
            self._num_waiting -= 1  # stays in the heap, skipped when it reaches the top
        self._finish(req, "abort")
        return True

    # -- time ------------------------------------------------------------------------------
    def advance(self, until: float) -> list[RequestOutput]:
        """Run every step that starts before ``until``; idle time jumps to ``until``."""
        while self.now < until and self.busy:
            steady = self._step()
            if steady:
                self._fast_forward(until)
        if not self.busy and self.now < until != math.inf:
            self.now = until
        return self._drain()

    def step(self) -> list[RequestOutput]:
        """Run exactly one step (no fast-forward); nothing happens when idle."""
        if self.busy:
            self._step()
        return self._drain()

    def _drain(self) -> list[RequestOutput]:
        outs = list(self._outs.values())
        self._outs = {}
        return outs

    # -- one step --------------------------------------------------------------------------
    def _step(self) -> bool:
        """Schedule and run one step. True when it was steady (decodes only, nothing changed)."""
        self._changes += 1
        batch: dict[_Req, int] = {}
        budget, preempted = self._schedule_running(batch)
        admitted = 0 if preempted else self._admit_waiting(batch, budget)
        if not batch:  # EngineConfig validation makes this unreachable; never spin
            raise RuntimeError("engine could schedule nothing although it has requests")
        prefill = decodes = context = 0
        for req, new in batch.items():
            if new == 1 and req.output > 0 and req.computed == req.num_tokens - 1:
                decodes += 1
            else:
                prefill += new
            context += req.computed + new
        self.now += self.config.cost.step_time(prefill, decodes, context)
        self.stats.steps += 1
        self.stats.prefill_tokens_computed += prefill
        finished = self._apply(batch)
        return (
            prefill == 0 and not preempted and admitted == 0 and not finished
            and len(batch) == len(self._running)
        )

    def _schedule_running(self, batch: dict[_Req, int]) -> tuple[int, bool]:
        budget = self.config.max_num_batched_tokens
        preempted = False
        for req in list(self._running):
            if budget <= 0:
                break
            if req.state != _RUNNING:
                continue  # preempted earlier in this step
            new = min(req.num_tokens - req.computed, budget)
            while not self._grow(req, req.computed + new):
                victim = self._victim()
                budget += batch.pop(victim, 0)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                batch[req] = new
                budget -= new
                if req.next_reg < len(req.hashes):  # a prefill chunk
                    self._register(req, req.computed + new)
        return budget, preempted

    def _admit_waiting(self, batch: dict[_Req, int], budget: int) -> int:
        admitted = 0
        bs, cache = self._bs, self.cache
        while self._num_waiting and len(self._running) < self.config.max_num_seqs and budget > 0:
            req = self._peek_waiting()
            # vLLM always recomputes at least the last prompt token
            limit = min(len(req.hashes), (req.num_tokens - 1) // bs)
            hits = cache.match(req.hashes, limit)
            hit_hashes = req.hashes[:hits]
            start = hits * bs
            new = min(req.num_tokens - start, budget)
            need = -(-(start + new) // bs) - hits
            if need > cache.available() - cache.evictable_among(hit_hashes):
                break
            cache.acquire(hit_hashes)
            cache.allocate(need)
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            req.cached, req.private = list(hit_hashes), need
            req.computed, req.next_reg, req.state = start, hits, _RUNNING
            self._register(req, start + new)
            if not req.admitted_once:
                # vLLM counts a preempted request's return apart (PrefixCacheStats.record,
                # v1/metrics/stats.py): its own recomputed blocks are not the cache's hits
                self.stats.prefix_cache_queries += req.num_tokens
                self.stats.prefix_cache_hits += start
                req.admitted_once, req.cached_tokens = True, start
                req.scheduled_at = self.now
            self._running.append(req)
            batch[req] = new
            budget -= new
            admitted += 1
        return admitted

    def _apply(self, batch: dict[_Req, int]) -> int:
        finished = 0
        now = self.now
        for req, new in batch.items():
            req.computed += new
            if req.computed == req.num_tokens:
                req.output += 1
                req.num_tokens += 1
                self.stats.generation_tokens += 1
                out = self._out(req)
                out.new_tokens += 1
                out.time = now
                if req.first_token_time is None:
                    req.first_token_time = out.first_token_time = now
                    stats = self.stats
                    stats.prompt_tokens += req.prompt
                    # vLLM's request_prefill_time_seconds / _kv_computed_tokens histograms
                    stats.prefill_requests += 1
                    stats.prefill_seconds += now - (req.scheduled_at or now)
                    stats.prefill_computed_tokens += req.prompt - req.cached_tokens
                if req.output >= req.target:
                    self._finish(req, req.reason)
                    finished += 1
        return finished

    def _register(self, req: _Req, tokens: int) -> None:
        """Cache the full prompt blocks among ``req``'s first ``tokens`` (computed and just
        scheduled), as vLLM V1 does when it allocates a step's slots. A request preempted
        after this keeps nothing, and the blocks stay cached, evictable, as vLLM's `free`
        leaves them (this engine cannot preempt a request in the step that cached its
        blocks: a chunk that is not a prompt's last uses up the step's budget, and every
        running request after a prefilling one was admitted after its prefill ended)."""
        full = min(tokens // self._bs, len(req.hashes))
        for i in range(req.next_reg, full):
            h = req.hashes[i]
            if self.cache.register(h):
                req.cached.append(h)
                req.private -= 1
        req.next_reg = full

    # -- blocks, preemption, finishing -----------------------------------------------------
    def _grow(self, req: _Req, tokens: int) -> bool:
        need = -(-tokens // self._bs) - req.blocks()
        if need <= 0:
            return True
        if not self.cache.allocate(need):
            return False
        req.private += need
        return True

    def _victim(self) -> _Req:
        if self.config.scheduling_policy == "priority":
            return max(self._running, key=lambda r: r.prio_key)
        return self._running[-1]

    def _preempt(self, req: _Req) -> None:
        self._free(req)
        self._running.remove(req)
        req.state, req.computed, req.next_reg = _WAITING, 0, 0
        req.preemptions += 1
        self.stats.preemptions += 1
        heapq.heappush(self._waiting, req)
        self._num_waiting += 1

    def _free(self, req: _Req) -> None:
        self.cache.release(req.cached, req.private)
        req.cached, req.private = [], 0

    def _finish(self, req: _Req, reason: str) -> None:
        if req.state == _RUNNING:
            self._running.remove(req)
        self._free(req)
        req.state = _DONE
        del self._reqs[req.id]
        self.stats.finished[reason] += 1
        out = self._out(req)
        out.finish_reason = reason
        if reason == "abort":
            out.time = self.now

    def _out(self, req: _Req) -> RequestOutput:
        out = self._outs.get(req.id)
        if out is None:
            out = self._outs[req.id] = RequestOutput(req.id)
        out.num_output_tokens = req.output
        out.cached_tokens = req.cached_tokens
        out.num_preemptions = req.preemptions
        out.prompt_tokens = req.prompt
        out.scheduled_time = req.scheduled_at
        return out

    def _peek_waiting(self) -> _Req:
        heap = self._waiting
        while heap[0].state != _WAITING:
            heapq.heappop(heap)  # aborted while waiting
        return heap[0]

    # -- fast-forward ----------------------------------------------------------------------
    def _fast_forward(self, until: float) -> None:
        running = self._running
        plan = plan_fast_forward(
            [(r.computed, r.target - r.output, r.blocks()) for r in running],
            self.cache.available(), self._bs, self.config.cost, self.now, until,
        )
        if plan is None:
            return
        self._changes += 1
        k, duration, need = plan
        self.cache.allocate(need)
        self.now += duration
        bs, now = self._bs, self.now
        for r in running:
            r.computed += k
            r.output += k
            r.num_tokens += k
            r.private += -(-r.computed // bs) - r.blocks()
            out = self._out(r)
            out.new_tokens += k
            out.time = now
        self.stats.generation_tokens += k * len(running)
        self.stats.steps += k
        self.stats.fast_forwarded_steps += k
