"""The Lua scripts of the shared rate limits (`redis_limits`): admission (with the releases
that failed earlier, in the same call), settle, release and lease renewal. Each runs on one
tenant's keys, which share a hash tag, except the renewal, which takes every live lease's,
and the admission's lease holders' heartbeats (`holders.py`)."""

from __future__ import annotations

from gateway.tenancy.limits import HOLD_WEIGHT

__all__ = ["ADMIT", "HOLD_KEEP_MS", "RELEASE", "RENEW", "SETTLE"]

# how long a tenant's leases' take times and mean hold time outlive its last lease taken or
# released: an hour (a lease renewed longer than that waits 1 s, as before)
HOLD_KEEP_MS = 3_600_000

_NOW = (
    "local now = tonumber(ARGV[1]) "
    "if not now then local t = redis.call('TIME') now = tonumber(t[1]) + tonumber(t[2]) / 1e6 end "
)
# The bucket hash lives until both levels are full again (a missing bucket starts full): a
# minute and a second, longer while tokens are owed (a level below zero refills at tpm a
# minute). `KEEP(t, tpm)` pushes its expiry out to that, never in. A fixed 61 s forgave any
# debt older than that: 3,000 tokens used on a 600 TPM budget were answered Retry-After
# 241 s, and the next request 63 s later was admitted on a full bucket.
_KEEP = """
local function keep(bucket, t, tpm)
  local ms = 61000
  if tpm > 0 and t < 0 then ms = math.ceil((tpm - t) * 60000 / tpm) + 1000 end
  if redis.call('PTTL', bucket) < ms then redis.call('PEXPIRE', bucket, string.format('%d', ms)) end
end
"""
# A concurrency refusal's wait, fleet-wide: the tenant's mean hold time (KEYS[6], kept by
# `RELEASE`) less the age of its oldest lease (KEYS[5]: lease id -> when taken, Redis time),
# 1 to 60 s; 1 s when either is unknown. The process refusing may hold none of the leases:
# another gateway's streams hold them (it used to say 1 s then, `limits.HoldTimes` seeing
# this process's leases only). Entries of KEYS[5] whose lease is gone (expired, a dead
# holder's) are dropped here.
_HELD_WAIT = f"local HOLD_KEEP_MS = {HOLD_KEEP_MS}\n" + """
local function held_wait(t)
  local oldest = nil
  local taken = redis.call('ZRANGE', KEYS[5], 0, -1, 'WITHSCORES')
  for i = 1, #taken, 2 do
    if redis.call('ZSCORE', KEYS[2], taken[i]) then
      local at = tonumber(taken[i + 1])
      if oldest == nil or at < oldest then oldest = at end
    else
      redis.call('ZREM', KEYS[5], taken[i])
    end
  end
  local mean = tonumber(redis.call('GET', KEYS[6]) or '')
  if oldest == nil or mean == nil then return 1 end
  return math.min(60, math.max(1, mean - (t - oldest)))
end
"""
# KEYS[1] bucket hash, KEYS[2] lease zset, KEYS[3] reservation zset, KEYS[4] the set of
# the holders of the tenant's leases, KEYS[5] and KEYS[6] its leases' take times and mean
# hold time (`_HELD_WAIT`).
# ARGV: now|'' , rpm, tpm, max_concurrency (0 = unlimited), estimated tokens, lease id, ttl,
# peek ('1': decide only, write nothing), the prefix of the lease holders' heartbeat keys, this
# process's holder id, its heartbeat's ttl, then the tenant's releases that failed earlier, as
# `RELEASE` takes them (lease id, tokens reserved, tpm), done first: in the same round trip.
# A tenant found full drops the holders in KEYS[4] whose heartbeat is gone, and their leases
# (`<holder>.<random>`: the lease zset is read only when a holder is gone; a lease id without
# a holder, from an older kvgate, is kept to its TTL); an admission with a concurrency limit
# keeps its own holder's heartbeat alive, and one that takes a lease names its holder in
# KEYS[4] first (a WRONGTYPE there takes no lease).
# A refusal names the first limit that refuses (concurrency, rpm, tpm) and waits for the last
# (a tenant at its concurrency limit with its RPM spent was told 1 s, then 60 s more); a TPM
# bucket's wait is until its balance is above zero (`limits.tpm_wait`: a millisecond past it).
# A reservation without a lease (no concurrency limit) is marked in KEYS[3] under the lease
# id, scored by its expiry, before the bucket is written (a WRONGTYPE there reserves nothing).
ADMIT = (
    _NOW
    + _KEEP
    + _HELD_WAIT
    + """
for i = 12, #ARGV, 3 do
  if (redis.call('ZREM', KEYS[2], ARGV[i]) == 1 or redis.call('ZREM', KEYS[3], ARGV[i]) == 1)
      and tonumber(ARGV[i + 1]) > 0 then
    local t = tonumber(redis.call('HGET', KEYS[1], 't'))
    if t then
      redis.call('HSET', KEYS[1], 't', math.min(tonumber(ARGV[i + 2]), t + tonumber(ARGV[i + 1])))
    end
  end
end
local rpm, tpm, conc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local est, ttl = tonumber(ARGV[5]), tonumber(ARGV[7])
local b = redis.call('HMGET', KEYS[1], 'r', 't', 'ts')
local dt = math.max(0, now - (tonumber(b[3]) or now))
local r = 0
local t = 0
if rpm > 0 then r = math.min(rpm, (tonumber(b[1]) or rpm) + dt * rpm / 60) end
if tpm > 0 then t = math.min(tpm, (tonumber(b[2]) or tpm) + dt * tpm / 60) end
local inflight = 0
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  inflight = redis.call('ZCARD', KEYS[2])
  if ARGV[8] ~= '1' then
    redis.call('SET', ARGV[9] .. ARGV[10], '1', 'PX', math.ceil(tonumber(ARGV[11]) * 1000))
  end
  if inflight >= conc then
    local dead = nil
    for _, h in ipairs(redis.call('SMEMBERS', KEYS[4])) do
      if h ~= ARGV[10] and redis.call('EXISTS', ARGV[9] .. h) == 0 then
        dead = dead or {}
        dead[h] = true
        redis.call('SREM', KEYS[4], h)
      end
    end
    if dead then
      for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
        local h = string.match(id, '^(%x+)%.')
        if h and dead[h] then
          redis.call('ZREM', KEYS[2], id)
          inflight = inflight - 1
        end
      end
    end
  end
end
local reason = ''
local retry = 0
if conc > 0 and inflight >= conc then reason = 'concurrency' retry = held_wait(now) end
if rpm > 0 and r < 1 then
  if reason == '' then reason = 'rpm' end
  retry = math.max(retry, (1 - r) * 60 / rpm)
end
if tpm > 0 and t <= 0 then
  if reason == '' then reason = 'tpm' end
  retry = math.max(retry, -t * 60 / tpm + 0.001)
end
if ARGV[8] == '1' then return {reason, tostring(retry), tostring(r), tostring(t)} end
if reason == '' then
  if rpm > 0 then r = r - 1 end
  if tpm > 0 then t = t - est end
  if conc > 0 then
    redis.call('SADD', KEYS[4], ARGV[10])
    redis.call('PEXPIRE', KEYS[4], math.ceil(ttl * 1000) + 1000)
    redis.call('ZADD', KEYS[2], now + ttl, ARGV[6])
    redis.call('PEXPIRE', KEYS[2], math.ceil(ttl * 1000) + 1000)
    redis.call('ZADD', KEYS[5], now, ARGV[6])
    redis.call('PEXPIRE', KEYS[5], HOLD_KEEP_MS)
  elseif tpm > 0 and est > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
    redis.call('ZADD', KEYS[3], now + ttl, ARGV[6])
    redis.call('PEXPIRE', KEYS[3], math.ceil(ttl * 1000) + 1000)
  end
end
if rpm > 0 then redis.call('HSET', KEYS[1], 'r', r) else redis.call('HDEL', KEYS[1], 'r') end
if tpm > 0 then redis.call('HSET', KEYS[1], 't', t) else redis.call('HDEL', KEYS[1], 't') end
redis.call('HSET', KEYS[1], 'ts', now)
keep(KEYS[1], t, tpm)
return {reason, tostring(retry), tostring(r), tostring(t)}
"""
)
# KEYS[1] bucket hash, KEYS[2] reservation zset; ARGV[1] extra tokens to charge (may be
# negative), ARGV[2] tpm (0: none), ARGV[3] the reservation's mark ('' for none), ARGV[4]
# the rpm of a request never served, whose request is given back (0: served, none).
SETTLE = _KEEP + """
if ARGV[3] ~= '' then redis.call('ZREM', KEYS[2], ARGV[3]) end
local tpm = tonumber(ARGV[2])
local t = tonumber(redis.call('HGET', KEYS[1], 't'))
if t and tpm > 0 then
  t = math.min(tpm, t - tonumber(ARGV[1]))
  redis.call('HSET', KEYS[1], 't', t)
  keep(KEYS[1], t, tpm)
end
local rpm = tonumber(ARGV[4] or '0') or 0
local r = tonumber(redis.call('HGET', KEYS[1], 'r'))
if r and rpm > 0 then redis.call('HSET', KEYS[1], 'r', math.min(rpm, r + 1)) end
return 1
"""
# KEYS[1] bucket hash, KEYS[2] lease zset, KEYS[3] reservation zset, KEYS[5] take times,
# KEYS[6] mean hold time; ARGV[1] lease id, ARGV[2] tokens reserved at its admission, ARGV[3]
# tpm, ARGV[4] (optional) how long the lease was held, s, folded into the tenant's mean (a
# release retried after an outage has none). A lease (or a reservation's mark) that was
# still there was taken by an admission nobody used: its reservation is given back.
RELEASE = f"local HOLD_KEEP_MS, HOLD_WEIGHT = {HOLD_KEEP_MS}, {HOLD_WEIGHT}\n" + """
if (redis.call('ZREM', KEYS[2], ARGV[1]) == 1 or redis.call('ZREM', KEYS[3], ARGV[1]) == 1)
    and tonumber(ARGV[2]) > 0 then
  local t = tonumber(redis.call('HGET', KEYS[1], 't'))
  if t then redis.call('HSET', KEYS[1], 't', math.min(tonumber(ARGV[3]), t + tonumber(ARGV[2]))) end
end
local function typed(key, want)  -- a key written by hand must not fail the release for ever
  local t = redis.call('TYPE', key)['ok']
  return t == want or t == 'none'
end
if KEYS[5] and typed(KEYS[5], 'zset') then redis.call('ZREM', KEYS[5], ARGV[1]) end
local took = tonumber(ARGV[4] or '')
if took and KEYS[6] and typed(KEYS[6], 'string') then
  local mean = tonumber(redis.call('GET', KEYS[6]) or '')
  if mean then took = mean + HOLD_WEIGHT * (took - mean) end
  redis.call('SET', KEYS[6], tostring(took), 'PX', HOLD_KEEP_MS)
end
return 1
"""
# KEYS = per tenant with live leases, its lease zset and its holders set; ARGV[1] now|'',
# ARGV[2] ttl, ARGV[3] this process's holder id, then per tenant the number of its live leases
# and their ids. A key of another type (written by hand) is skipped: it would fail every
# tenant's renewal. The holders set lives as long as the leases (and names this holder again).
RENEW = (
    _NOW
    + """
local ttl = tonumber(ARGV[2])
local ms = math.ceil(ttl * 1000) + 1000
local a = 4
for i = 1, #KEYS, 2 do
  local n = tonumber(ARGV[a])
  if redis.call('TYPE', KEYS[i])['ok'] == 'zset' then
    for j = a + 1, a + n do redis.call('ZADD', KEYS[i], 'XX', now + ttl, ARGV[j]) end
    redis.call('PEXPIRE', KEYS[i], ms)
    local t = redis.call('TYPE', KEYS[i + 1])['ok']
    if t == 'set' or t == 'none' then
      redis.call('SADD', KEYS[i + 1], ARGV[3])
      redis.call('PEXPIRE', KEYS[i + 1], ms)
    end
  end
  a = a + n + 1
end
return #KEYS / 2
"""
)

