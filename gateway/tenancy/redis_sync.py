"""The Redis store's reads that keep a gateway in step: the generation counter (with its
write probe), the bootstrap marker, whole snapshots and the journal's reads of what changed,
and the restores of a wiped store or a lost hash (see `redis_base` for the layout)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from redis.exceptions import RedisError, ResponseError, WatchError

from gateway.errors import StoreUnreachable
from gateway.tenancy.models import Change, SkippedRecord, StoreSnapshot
from gateway.tenancy.redis_base import JOURNAL_READ, KINDS, PRESENT, RedisBase, records
from gateway.tenancy.redis_conn import failure_cause, redis_unavailable, refusal_code
from gateway.tenancy.redis_records import (
    changed_keys,
    counter,
    policy_from,
    read_epoch,
    read_record,
    readable_records,
    skipped_record,
    text,
)
from gateway.tenancy.store import key_from_json, tenant_to_json

__all__ = ["RedisSync"]


class RedisSync(RedisBase):
    """The store's reads and restores that keep the gateway's view in step with Redis."""

    async def generation(self) -> int:
        """The counter, read with a write that changes nothing (DEL of a key never set) in
        the same round trip: a Redis turned read-only (a failover left KVGATE_REDIS_URL on the
        old primary, now a replica) answers every read, in a MULTI too, and refuses only
        writes (READONLY): no load told, and /readyz said nothing while admin writes failed.
        A full Redis takes the DEL (it frees memory): that refusal is the loads' to tell."""
        with redis_unavailable():
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.get(self._k("gen"))
                pipe.delete(self._k("write_probe"))
                raw, probe = await pipe.execute(raise_on_error=False)
        if isinstance(raw, Exception):
            raise StoreUnreachable(failure_cause(raw))
        self._judge_writes(probe)
        return counter(raw)

    def _judge_writes(self, probe: object) -> None:
        """Note a read-only Redis from the probe's reply, and forget it once writes pass."""
        cause = failure_cause(probe) if isinstance(probe, RedisError) else None
        if cause is not None and refusal_code(cause) == "READONLY":
            self._read_only = self.refusing_writes = cause
        elif self._read_only is not None and isinstance(probe, int):
            if self.refusing_writes == self._read_only:
                self.refusing_writes = None
            self._read_only = None

    async def mark_seeded(self) -> None:
        mark = json.dumps({"id": secrets.token_hex(8), "at": time.time()})
        with redis_unavailable():
            await self._scripts["mark"](keys=[
                self._k("seeded"), self._k("tenants"), self._k("keys"), self._k("present")],
                args=[mark])

    async def seed_mark(self) -> str | None:
        with redis_unavailable():
            raw = await self._r.get(self._k("seeded"))
        return None if raw is None else text(raw)

    async def up_for_s(self) -> float | None:
        """INFO server's `uptime_in_seconds`; None when INFO is refused (a managed Redis's
        ACL) or does not carry it. Not reached (a timeout on a loaded machine): raised, the
        check fails and is tried again -- read as "does not say", it restored a state the
        store may have revoked parts of."""
        try:
            with redis_unavailable():
                info = await self._r.info("server")
        except StoreUnreachable as exc:
            if refusal_code(exc.cause) is None:
                raise
            return None
        up = info.get("uptime_in_seconds") if isinstance(info, dict) else None
        return float(up) if isinstance(up, (int, float)) else None

    async def restore(self, snap: StoreSnapshot) -> bool:
        """MULTI/EXEC under WATCH of the marker and the counter: the marker still missing,
        the records are written over whatever a seed wrote meanwhile (the state restored is
        at least as new), the counter set past both, the journal started again with one
        entry (a reload reads the store whole), the marker set, a resync published. A
        concurrent write (a seed) retries; the marker set by another gateway gives up."""
        seeded, gen = self._k("seeded"), self._k("gen")
        tkeys: dict[str, dict[str, str]] = {}
        for key_hash, record in snap.keys.items():
            tkeys.setdefault(self._k("tkeys", record.tenant_id), {})[record.key_id] = key_hash
        with redis_unavailable():
            async with self._r.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(seeded, gen)
                        if await pipe.exists(seeded):
                            return False
                        generation = max(counter(await pipe.get(gen)), snap.generation) + 1
                        mark = {"id": secrets.token_hex(8), "at": time.time(),
                                "restored": snap.generation}
                        pipe.multi()  # type: ignore[no-untyped-call, unused-ignore]
                        self._restore_records(pipe, snap, tkeys)
                        pipe.set(gen, generation)
                        pipe.delete(self._k("journal"))
                        pipe.lpush(self._k("journal"), f"{generation} restore *")
                        pipe.set(seeded, json.dumps(mark))
                        pipe.publish(self.channel, json.dumps({"kind": "resync", "id": None}))
                        await pipe.execute()
                        return True
                    except WatchError:
                        continue  # a write meanwhile: look at the marker again

    async def restore_lost(self, kind: str, snap: StoreSnapshot) -> int | None:
        """One script (`redis_scripts.RESTORE_LOST`): the hash still missing, the records the
        journal does not name since `snap.generation` written back, journaled and published."""
        keys, args = [], [snap.generation, kind]
        if kind == "tenant":
            keys = [self._k("tenants")]
            for tid, tenant in snap.tenants.items():
                args += [tid, tenant_to_json(tenant)]
        else:
            keys = [self._k("keys")]
            for key_hash, record in snap.keys.items():
                keys.append(self._k("tkeys", record.tenant_id))
                args += [key_hash, record.model_dump_json(), record.key_id]
        written = await self._run("lost", keys, args, Change("resync"))
        return None if written == -2 else max(written, 0)

    def _restore_records(
        self, pipe: Any, snap: StoreSnapshot, tkeys: dict[str, dict[str, str]]
    ) -> None:
        pipe.hset(self._k("tenants"), mapping={
            PRESENT: "", **{tid: tenant_to_json(t) for tid, t in snap.tenants.items()}})
        pipe.hset(self._k("keys"), mapping={
            PRESENT: "", **{h: record.model_dump_json() for h, record in snap.keys.items()}})
        pipe.set(self._k("present"), "1")
        for name, ids in tkeys.items():
            pipe.hset(name, mapping=ids)
        if snap.policy is not None:
            pipe.hset(self._k("policy"), mapping={
                "version": max(snap.policy.version, 1),  # 0: "none stored"
                "doc": snap.policy.doc.model_dump_json(exclude_unset=True)})
        if snap.group_epochs:
            pipe.hset(self._k("salt_groups"), mapping=dict(snap.group_epochs))

    async def snapshot(self) -> StoreSnapshot:
        def reads(pipe: Any) -> None:
            pipe.get(self._k("gen"))
            pipe.hgetall(self._k("tenants"))
            pipe.hgetall(self._k("keys"))
            pipe.hgetall(self._k("policy"))
            pipe.hgetall(self._k("salt_groups"))
            pipe.lindex(self._k("journal"), 0)
            pipe.exists(self._k("present"))

        gen, tenants, keys, policy, groups, head, present = await self._read_together(reads)
        self._key_records(records(keys))
        self._journal_head = None if head is None else text(head)
        snap = self._snapshot(counter(gen), records(tenants), policy, groups)
        if not present:
            return snap
        lost = frozenset(KINDS[name] for name, raw in (("tenants", tenants), ("keys", keys))
                         if PRESENT not in raw and PRESENT.encode() not in raw)
        return replace(snap, lost=lost) if lost else snap

    async def changes_since(self, generation: int) -> StoreSnapshot | None:
        """The journal's way: the small records read whole, the key records only where the
        journal says they changed since `generation` (the last snapshot this store made). One
        transaction reads the counter, the journal's newest entries, the tenants, the policy
        and the salt groups; a second one the changed key records, checked against the same
        counter. None (make a whole `snapshot`) unless the journal accounts for every
        generation in between and goes on with the entry that was its newest at
        `generation`: a write behind the store's back (no journal entry), a trimmed journal,
        a wiped store written again as far, another write meanwhile."""
        if generation != self._view_generation:
            return None
        def reads(pipe: Any) -> None:
            pipe.get(self._k("gen"))
            pipe.lrange(self._k("journal"), 0, JOURNAL_READ - 1)
            pipe.hgetall(self._k("tenants"))
            pipe.hgetall(self._k("policy"))
            pipe.hgetall(self._k("salt_groups"))

        gen, journal, tenants, policy, groups = await self._read_together(reads)
        now = counter(gen)
        entries = [text(e) for e in journal]
        hashes = changed_keys(entries, generation, now, self._journal_head)
        if hashes is None:
            return None
        base = self._keys
        if hashes:
            def changed(pipe: Any) -> None:
                pipe.get(self._k("gen"))
                pipe.hmget(self._k("keys"), hashes)

            again, raws = await self._read_together(changed)
            if counter(again) != now:
                return None
            self._update_keys(dict(zip(hashes, raws, strict=True)))
        self._journal_head = entries[0]
        snap = self._snapshot(now, records(tenants), policy, groups)
        return replace(snap, keys_from=base, keys_changed=frozenset(hashes))

    async def _read_together(self, reads: Callable[[Any], None]) -> list[Any]:
        """The replies of `reads` (queued on a pipeline) read in one MULTI/EXEC, so they see
        one state. A Redis full under ``noeviction`` refuses every command queued in a MULTI,
        reads included (OOM): then they are read pipelined without one. That is safe: the
        counter is read first, so a write landing between the reads (only a delete runs on a
        full Redis) leaves records newer than the counter, and the next check reloads. Without
        it a full Redis that still held every key and policy turned a gateway started then
        away from every request (503), and the running ones once `max_staleness_s` passed."""
        with redis_unavailable():
            try:
                async with self._r.pipeline(transaction=True) as pipe:
                    reads(pipe)
                    replies = list(await pipe.execute())
                self.refusing_writes = self._read_only  # (a full Redis reads in a MULTI no more)
                return replies
            except ResponseError as exc:
                if refusal_code(cause := failure_cause(exc)) != "OOM":
                    raise
                self.refusing_writes = cause
            async with self._r.pipeline(transaction=False) as pipe:
                reads(pipe)
                return list(await pipe.execute())

    def _snapshot(
        self, generation: int, tenants: dict[str, str], policy: dict[str, str],
        groups: dict[str, str],
    ) -> StoreSnapshot:
        # an unreadable record is left out (and reported), never the whole load failed: one
        # bad record must not turn every tenant away once the last good state is too stale
        skipped: list[SkippedRecord] = []
        readable = self._tenant_records.readable(tenants, "tenant", skipped)
        skipped.extend(self._bad_keys.values())
        self._view_generation = generation
        return StoreSnapshot(
            generation=generation,
            tenants=readable,
            keys=self._keys,  # never changed once handed out (`_update_keys` copies)
            policy=policy_from(policy, skipped),
            group_epochs=readable_records(groups, read_epoch, "salt_group", skipped),
            skipped=tuple(skipped),
        )

    def _key_records(self, raw: dict[str, str]) -> None:
        """The key records of a whole snapshot, each parsed once: a reload parses only the
        records that changed (~5 µs each)."""
        known = self._parsed_keys
        parsed = {k: seen if (seen := known.get(k)) is not None and seen[0] == v
                  else (v, read_record(v, key_from_json)) for k, v in raw.items()}
        self._parsed_keys = parsed
        self._bad_keys = {k: skipped_record("key", k, v) for k, (v, record) in parsed.items()
                          if record is None}
        self._keys = {k: record for k, (_, record) in parsed.items() if record is not None}
        by_tenant: dict[str, dict[str, str]] = {}
        for key_hash, record in self._keys.items():
            by_tenant.setdefault(record.tenant_id, {})[key_hash] = record.key_id
        self._tenant_keys = by_tenant

    def _update_keys(self, changed: dict[str, str | None]) -> None:
        """Apply the key records the journal named (None: gone) to a copy of the view."""
        keys = dict(self._keys)
        for key_hash, raw in changed.items():
            if (gone := keys.pop(key_hash, None)) is not None:
                self._unindex(gone.tenant_id, key_hash)
            self._bad_keys.pop(key_hash, None)
            self._parsed_keys.pop(key_hash, None)
            if raw is None:
                continue
            record = read_record(raw, key_from_json)
            self._parsed_keys[key_hash] = (raw, record)
            if record is None:
                self._bad_keys[key_hash] = skipped_record("key", key_hash, raw)
            else:
                keys[key_hash] = record
                self._tenant_keys.setdefault(record.tenant_id, {})[key_hash] = record.key_id
        self._keys = keys

    def _unindex(self, tenant_id: str, key_hash: str) -> None:
        """Take a key out of its tenant's entry of `_tenant_keys` (the entry gone with its
        last key, so a deleted tenant leaves none)."""
        held = self._tenant_keys.get(tenant_id)
        if held is not None:
            held.pop(key_hash, None)
            if not held:
                del self._tenant_keys[tenant_id]
