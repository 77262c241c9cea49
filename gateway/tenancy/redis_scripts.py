"""The Lua scripts of the Redis tenancy store's conditional writes (`redis_store`): each
checks its condition, writes, bumps the generation counter, publishes the change and journals
the records it changed, in one atomic step."""

from __future__ import annotations

__all__ = ["ADD_KEY", "CAS_TENANT", "CREATE", "DELETE", "JOURNAL_CAP", "MARK_SEEDED",
           "PUT_POLICY", "RESTORE_LOST", "REVOKE", "ROTATE_GROUP"]

# Every script: KEYS[1] = generation counter, KEYS[2] = the change journal; ARGV[1] = channel,
# ARGV[2] = change message. The admin writes' (all but RESTORE_LOST and MARK_SEEDED) also take
# the audit log as their last KEYS and the log's cap and an audit entry as their last two ARGV
# (`_audit`), after those each names below. Each write bumps the counter, publishes, and
# journals what it changed, one entry per record: "<generation> <kind> <name>"
# (`changes_since`).
_BUMP = "local g = redis.call('INCR', KEYS[1]) redis.call('PUBLISH', ARGV[1], ARGV[2]) "
# Each script first checks the counter: one that holds no integer INCR can bump (written by
# hand: not an integer, or past a signed 64-bit one's range, or at its largest) is refused
# with WRONGTYPE, as a key of another type, before anything is written (INCR failed only
# after the script had written its record: not journaled, not published). Digits compared
# as strings of one length (Lua's numbers are doubles). `key_types.bumpable` is the same
# rule where the counter is read.
_GUARD = (
    "local g0 = redis.call('GET', KEYS[1]) "
    "if g0 and g0 ~= '0' then local d = string.match(g0, '^-?([1-9]%d*)$') "
    "if not d or #d > 19 or (#d == 19 and ((g0 == d and d >= '9223372036854775807') "
    "or (g0 ~= d and d > '9223372036854775808'))) then "
    "return redis.error_reply('WRONGTYPE ' .. KEYS[1] .. ' is not an integer') end end "
)


def _shaped(*hashes: int) -> str:
    """Refuse with WRONGTYPE, before anything is written, a script whose hashes (these KEYS)
    or lists (the journal, the audit log: KEYS[2], the last KEYS) hold another type (written
    by hand): Redis keeps what a script wrote before an error, so the tenant deletion that
    failed on a string at the tenant's key index had removed the tenant and left its key
    records, unjournaled: the tenant made again under its id got its old keys back."""
    checks = " or ".join(f"bad(KEYS[{i}], 'hash')" for i in hashes)
    return (
        "local function bad(k, want) local t = redis.call('TYPE', k).ok "
        "if t ~= want and t ~= 'none' then return redis.error_reply("
        "'WRONGTYPE ' .. k .. ' is not a ' .. want) end end "
        f"local wrong = bad(KEYS[2], 'list') or bad(KEYS[#KEYS], 'list') or {checks} "
        "if wrong then return wrong end "
    )


JOURNAL_CAP = 1024  # entries kept: enough for every reload that follows a write


def _log(kind: str, name: str) -> str:
    """Journal one changed record (`name`: a Lua expression), then trim the journal."""
    return (f"redis.call('LPUSH', KEYS[2], g .. ' {kind} ' .. {name}) "
            f"redis.call('LTRIM', KEYS[2], 0, {JOURNAL_CAP - 1}) ")


def _audit(result: str | None = None) -> str:
    """An admin write's audit entry (the last ARGV; '' for none, the one before it the log's
    cap) appended to the audit log (the last KEYS) with the change it records: a change Redis
    ran after the gateway stopped waiting is audited all the same (`gateway.tenancy.audited`).
    `result`: a Lua expression of the script's result, put where the entry says ``"$result"``
    last (`audited.RESULT`, the last detail the store adds: a token id or group name that is
    ``$result`` comes before it; ``%d``: Lua 5.1 writes a 16-digit double as ``4.5e+15``)."""
    entry = "ARGV[#ARGV]" if result is None else (
        f"(string.gsub(ARGV[#ARGV], '^(.*)\"%$result\"', "
        f"'%1' .. string.format('%d', {result}), 1))")
    return (f"if ARGV[#ARGV] ~= '' then redis.call('LPUSH', KEYS[#KEYS], {entry}) "
            "redis.call('LTRIM', KEYS[#KEYS], 0, tonumber(ARGV[#ARGV - 1]) - 1) end ")


def _policy_at(arg: str) -> str:
    """A tenant written only while the policy (KEYS[4]) is at the version its tier was
    checked against (`arg`, '' for no check): else -1, nothing written."""
    return (f"if {arg} ~= '' and (redis.call('HGET', KEYS[4], 'version') or '0') ~= {arg} "
            "then return -1 end ")


CREATE = (  # KEYS[3] tenants, KEYS[4] policy; ARGV[3] id, ARGV[4] json, ARGV[5] version or ''
    _GUARD + "if redis.call('HEXISTS', KEYS[3], ARGV[3]) == 1 then return 0 end "
    + _policy_at("ARGV[5]") + "redis.call('HSET', KEYS[3], ARGV[3], ARGV[4]) "
    + _BUMP + _log("tenant", "ARGV[3]") + _audit()
    + "return 1"
)
CAS_TENANT = (  # KEYS[3] tenants, KEYS[4] policy; ARGV[3] id, ARGV[4] expected json, ARGV[5]
    # new json, ARGV[6] policy version or ''
    _GUARD + "if redis.call('HGET', KEYS[3], ARGV[3]) ~= ARGV[4] then return 0 end "
    + _policy_at("ARGV[6]")
    + "redis.call('HSET', KEYS[3], ARGV[3], ARGV[5]) " + _BUMP + _log("tenant", "ARGV[3]")
    + _audit() + "return 1"
)
# A tenant's key index (KEYS[5], key id -> hash) may be lost while its key records stay (an
# `allkeys-*` Redis evicts any key): the deletion and the revocation also take the hashes the
# gateway's view holds for the tenant, each used only if its record (KEYS[4]) still names the
# tenant (and the key id). Revoking by the index alone answered "not found" for a key that
# kept working, and a deleted tenant's keys worked again for a tenant made under its id.
_OWNED = (
    "local function owned(h, kid) local raw = redis.call('HGET', KEYS[4], h) "
    "if not raw then return false end local ok, r = pcall(cjson.decode, raw) "
    "return ok and type(r) == 'table' and r.tenant_id == ARGV[3] "
    "and (kid == nil or r.key_id == kid) end "
)
DELETE = (  # KEYS[3] tenants, KEYS[4] keys, KEYS[5] tkeys:<id>; ARGV[3] id, ARGV[4..] the
    # hashes of its keys in the gateway's view
    _GUARD + _shaped(3, 4, 5) + _OWNED
    + "if redis.call('HDEL', KEYS[3], ARGV[3]) == 0 then return 0 end "
    "local hs = redis.call('HVALS', KEYS[5]) local seen = {} "
    "for _, h in ipairs(hs) do seen[h] = true end "
    "for i = 4, #ARGV - 2 do local h = ARGV[i] "
    "if not seen[h] and owned(h) then seen[h] = true table.insert(hs, h) end end "
    "for _, h in ipairs(hs) do redis.call('HDEL', KEYS[4], h) end "
    "redis.call('DEL', KEYS[5]) " + _BUMP
    + "for _, h in ipairs(hs) do " + _log("key", "h") + "end "
    + _log("tenant", "ARGV[3]") + _audit() + "return 1"
)
# A key id the tenant's index holds, or a key hash the keys hash holds, is refused (-1): written
# over, the first key stayed in the keys hash, out of the index (never listed, not revocable
# by id), or was moved to another tenant whose revocation through the first then removed it.
ADD_KEY = (  # KEYS[3..5] tenants, keys, tkeys; ARGV[3..6] id, key id, hash, json
    _GUARD + _shaped(3, 4, 5)
    + "if redis.call('HEXISTS', KEYS[3], ARGV[3]) == 0 then return 0 end "
    "if redis.call('HEXISTS', KEYS[5], ARGV[4]) == 1 "
    "or redis.call('HEXISTS', KEYS[4], ARGV[5]) == 1 then return -1 end "
    "redis.call('HSET', KEYS[4], ARGV[5], ARGV[6]) redis.call('HSET', KEYS[5], ARGV[4], ARGV[5]) "
    + _BUMP + _log("key", "ARGV[5]") + _audit()
    + "return 1"
)
REVOKE = (  # KEYS[4] keys, KEYS[5] tkeys; ARGV[3] tenant id, ARGV[4] key id, ARGV[5] its hash
    # in the gateway's view or ''
    _GUARD + _shaped(4, 5) + _OWNED + "local h = redis.call('HGET', KEYS[5], ARGV[4]) "
    "if not h and ARGV[5] ~= '' and owned(ARGV[5], ARGV[4]) then h = ARGV[5] end "
    "if not h then return 0 end "
    "redis.call('HDEL', KEYS[4], h) redis.call('HDEL', KEYS[5], ARGV[4]) " + _BUMP
    + _log("key", "h") + _audit() + "return 1"
)
# A version that is not a number (a corrupted record) counts as the generation counter, which
# every write bumps: the next version is still past every one handed out before. With ARGV[5]
# (the generation read before the tenants the document was checked against), a tenant
# journaled since -- or a journal that no longer reaches back that far, or was restarted
# since -- returns 0, nothing written: a tier the document leaves out may have been given to a
# tenant meanwhile.
PUT_POLICY = (  # KEYS[3] policy; ARGV[3] expected version or '', ARGV[4] doc, ARGV[5] gen or ''
    _GUARD + "local v = tonumber(redis.call('HGET', KEYS[3], 'version') or '0') "
    "if not v then v = tonumber(redis.call('GET', KEYS[1]) or '0') end "
    "if ARGV[3] ~= '' and tonumber(ARGV[3]) ~= v then return -1 - v end "
    "if ARGV[5] ~= '' then local since = tonumber(ARGV[5]) local back = false "
    "local journal = redis.call('LRANGE', KEYS[2], 0, -1) "
    "for _, e in ipairs(journal) do local eg, ek = string.match(e, '^(%d+) (%S+)') "
    "if eg and tonumber(eg) <= since then back = true break end "
    "if not eg or ek == 'tenant' or ek == 'restore' then return 0 end end "
    f"if not back and #journal >= {JOURNAL_CAP} then return 0 end end "
    "redis.call('HSET', KEYS[3], 'version', v + 1, 'doc', ARGV[4]) " + _BUMP
    + _log("policy", "'policy'") + _audit("v + 1") + "return v + 1"
)
# An epoch that is not valid (`redis_records.epoch`: corrupted, "007", past 2**63 - 1) cannot
# be counted on: the group gets a fresh random one (ARGV[4]), a salt it never had, rather than
# an error or an old salt. HINCRBY refuses exactly what is not a valid epoch but a negative
# one ("007" and past 2**63 - 1: "not an integer"; 2**63 - 1 itself: "would overflow"), so
# its refusal (redis.pcall: an error reply, not a script failure) and a sign take the fresh
# epoch.
ROTATE_GROUP = (  # KEYS[3] salt_groups; ARGV[3] group, ARGV[4] a fresh epoch
    _GUARD + "local e = redis.call('HGET', KEYS[3], ARGV[3]) "
    "if e and string.match(e, '^%d+$') then e = redis.pcall('HINCRBY', KEYS[3], ARGV[3], 1) "
    "elseif not e then e = redis.call('HINCRBY', KEYS[3], ARGV[3], 1) end "
    "if type(e) ~= 'number' then "
    "redis.call('HSET', KEYS[3], ARGV[3], ARGV[4]) e = tonumber(ARGV[4]) end " + _BUMP
    + _log("salt", "ARGV[3]") + _audit("e") + "return e"
)
# A hash lost while the marker stayed (deleted whole by hand, evicted; deleting its last
# record leaves its "." field, `redis_store.PRESENT`, set again here), perhaps made again
# since without that field (a gateway's start seeding its configured tenants, an admin write):
# the records of a gateway's state in force written back, only while the hash still lacks the
# field (so one gateway of several does: -1 for the others) and never one the journal names
# since that state's generation (an operator's deletion: a tenant, its keys, a revoked key; a
# record written since, kept as it is); -2 when the journal cannot tell (an entry missing or
# trimmed away -- a generation's entries, one per key of a deleted tenant, partly --, a wiped
# store restored since, the counter behind that generation): nothing written.
RESTORE_LOST = (  # KEYS[3] the hash, KEYS[4..] each key's tkeys:<tenant> (keys only); ARGV[3]
    # the state's generation, ARGV[4] kind (tenant | key), then name, json(, key id) each
    _GUARD + "if redis.call('HEXISTS', KEYS[3], '.') == 1 then return -1 end "
    "local since = tonumber(ARGV[3]) local now = tonumber(redis.call('GET', KEYS[1]) or '0') "
    f"if now < since or now - since > {JOURNAL_CAP} then return -2 end "
    "local journal = redis.call('LRANGE', KEYS[2], 0, -1) "
    f"if #journal >= {JOURNAL_CAP} then "  # trimmed: its oldest entry must be older than since
    "local og = tonumber(string.match(journal[#journal], '^(%d+) ')) "
    "if not og or og > since then return -2 end end "
    "local named, seen = {}, {} "
    "for _, e in ipairs(journal) do "
    "local eg, ek, en = string.match(e, '^(%d+) (%S+) (.*)$') "
    "if eg and tonumber(eg) > since then "
    "if ek == 'restore' then return -2 end "
    "seen[tonumber(eg)] = true named[ek .. ' ' .. en] = true "
    "end end "
    "for i = since + 1, now do if not seen[i] then return -2 end end "
    "local step = 2 if ARGV[4] == 'key' then step = 3 end "
    "local back = {} "
    "redis.call('HSET', KEYS[3], '.', '') "
    "for i = 5, #ARGV, step do if not named[ARGV[4] .. ' ' .. ARGV[i]] then "
    "redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1]) "
    "if step == 3 then redis.call('HSET', KEYS[4 + (i - 5) / 3], ARGV[i + 2], ARGV[i]) end "
    "back[#back + 1] = ARGV[i] end end "
    "if #back == 0 then return 0 end " + _BUMP
    + "for _, n in ipairs(back) do redis.call('LPUSH', KEYS[2], g .. ' ' .. ARGV[4] .. ' ' .. n) "
    f"end redis.call('LTRIM', KEYS[2], 0, {JOURNAL_CAP - 1}) return #back"
)
# The bootstrap marker (KEYS[1] the marker, KEYS[2] tenants, KEYS[3] keys, KEYS[4] the
# layout's flag, `redis_store.PRESENT`'s; ARGV[1] the mark), run on every gateway's start: a
# new marker (a first seed, or a wiped store seeded again) comes with the hashes' "." field
# and the flag. With the marker there and no flag (a store seeded before the field was kept)
# the field is added to the hashes that exist, once; with the flag, nothing: a hash that is
# gone, or made again without the field (this start's configured tenants, an admin write),
# was lost, and a restarting gateway must not make it look emptied (`RESTORE_LOST`).
MARK_SEEDED = (
    "if redis.call('SET', KEYS[1], ARGV[1], 'NX') then "
    "redis.call('HSET', KEYS[2], '.', '') redis.call('HSET', KEYS[3], '.', '') "
    "redis.call('SET', KEYS[4], '1') return 1 end "
    "if redis.call('SET', KEYS[4], '1', 'NX') then "
    "for i = 2, 3 do if redis.call('EXISTS', KEYS[i]) == 1 then "
    "redis.call('HSETNX', KEYS[i], '.', '') end end end return 0"
)
