"""The Lua scripts of the consumer side: consumer groups, rollout claims, GRPO groups; see :mod:`sink.store.scripts`."""

from __future__ import annotations

from typing import Final

from sink.store.scripts.status import library_script

__all__ = (
    "CLAIM_SCRIPT",
    "GIVE_BACK_SCRIPT",
    "GROUP_CHECK_SCRIPT",
    "GROUP_CLOSE_SCRIPT",
    "GROUP_GATHER_SCRIPT",
    "RELEASE_SCRIPT",
    "RETIRE_CONSUMER_SCRIPT",
    "TOUCH_SCRIPT",
)


# --- consumer groups (sink.store.streams) ------------------------------------------------

# KEYS: the stream; ARGV: group, consumer, ids. Resets the idle time of the ids
# this consumer still owns (XCLAIM ... JUSTID keeps the delivery count).
# Returns {DONE, ids it no longer owns...} (reclaimed by another consumer, or acked).
TOUCH_SCRIPT: Final = library_script(
    "touch",
    """
local reply = {$DONE}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    reply[#reply + 1] = ARGV[i]
  end
end
return reply
""",
)

# KEYS: the stream; ARGV: group, consumer, idle ms, then pairs (id, delivery count). Makes each id this consumer
# still owns idle for that long, so any consumer's XAUTOCLAIM takes it at once, with that delivery count.
# Returns {DONE, ids it no longer owns...} (reclaimed by another consumer, or acked).
GIVE_BACK_SCRIPT: Final = library_script(
    "give_back",
    """
local reply = {$DONE}
for i = 4, #ARGV, 2 do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3], 'RETRYCOUNT', ARGV[i + 1], 'JUSTID')
  else
    reply[#reply + 1] = ARGV[i]
  end
end
return reply
""",
)

# KEYS: the stream; ARGV: group, consumer. Deletes the consumer only when it
# owns no pending entry (deleting it would drop them from the PEL).
# Returns {REMOVED} or {NOT_REMOVED}.
RETIRE_CONSUMER_SCRIPT: Final = library_script(
    "retire_consumer",
    """
if redis.call('EXISTS', KEYS[1]) == 0 then return {$NOT_REMOVED} end
local p = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if #p > 0 then return {$NOT_REMOVED} end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return {$REMOVED}
""",
)

# --- rollout claims (sink.trainer.reader.rollout_reader) --------------------------------------------------------

# KEYS: claim key, fence key; ARGV: token (stream#entry id), consumer, check fence ('1'/'0').
# Returns {status, the claim's previous value or ''}: CLAIM_RETIRED (the ledger was
# retired, so the rollout was consumed or given up already), CLAIM_DUPLICATE
# (another receipt entry owns the rollout) or CLAIM_CLAIMED (ours: new, or taken over).
CLAIM_SCRIPT: Final = library_script(
    "claim",
    """
local current = redis.call('GET', KEYS[1])
if ARGV[3] == '1' and redis.call('EXISTS', KEYS[2]) == 1 then return {$CLAIM_RETIRED, current or ''} end
if current and string.match(current, '^[^\\n]*') ~= ARGV[1] then return {$CLAIM_DUPLICATE, current} end
redis.call('SET', KEYS[1], ARGV[1] .. '\\n' .. ARGV[2])
return {$CLAIM_CLAIMED, current or ''}
""",
)

# KEYS: claim key; ARGV: token. Deletes the claim only if this entry still owns it.
# Returns {REMOVED} or {NOT_REMOVED}.
RELEASE_SCRIPT: Final = library_script(
    "release",
    """
local current = redis.call('GET', KEYS[1])
if current and string.match(current, '^[^\\n]*') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return {$REMOVED}
end
return {$NOT_REMOVED}
""",
)


# --- GRPO groups (sink.trainer.groups) ------------------------------------------------------------

# KEYS: meta, members. ARGV: member id, member record, owner (the caller), size, claim_idle_ms, ttl_ms.
# {GROUP_LATE} (nothing recorded) when the group went out already: closed (acknowledged, dropped, dead-lettered)
# or owned, and this member is not one of it. Else records the member; sizes that disagree keep the largest and
# set 'mismatch'. Then: {GROUP_COMPLETE, size, mismatch, members...} when this call completes the group (or finds
# it complete with no live owner) and makes the caller its owner (meta 'deliveries' counts the owners it had:
# above 1, the group was delivered before); {GROUP_OWNED} when the caller owns it already;
# {GROUP_TAKEN, owner} when a live rank owns it; {GROUP_WAIT} otherwise.
GROUP_GATHER_SCRIPT: Final = library_script(
    "group_gather",
    """
if redis.call('HGET', KEYS[1], 'closed') then return {$GROUP_LATE} end
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then return {$GROUP_LATE} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('HSETNX', KEYS[1], 'size', ARGV[4]) == 1 then
  redis.call('HSET', KEYS[1], 'first_at', now)
elseif tonumber(redis.call('HGET', KEYS[1], 'size')) ~= tonumber(ARGV[4]) then
  redis.call('HSET', KEYS[1], 'mismatch', '1')
  if tonumber(ARGV[4]) > tonumber(redis.call('HGET', KEYS[1], 'size')) then redis.call('HSET', KEYS[1], 'size', ARGV[4]) end
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
redis.call('PEXPIRE', KEYS[2], ARGV[6])
if owner == ARGV[3] then return {$GROUP_OWNED} end
if owner and now - tonumber(redis.call('HGET', KEYS[1], 'owner_at')) < tonumber(ARGV[5]) then
  return {$GROUP_TAKEN, owner}
end
local size = redis.call('HGET', KEYS[1], 'size')
if redis.call('HLEN', KEYS[2]) < tonumber(size) then return {$GROUP_WAIT} end
redis.call('HSET', KEYS[1], 'owner', ARGV[3], 'owner_at', now)
local mismatch = redis.call('HGET', KEYS[1], 'mismatch') or '0'
redis.call('HINCRBY', KEYS[1], 'deliveries', 1)
return {$GROUP_COMPLETE, size, mismatch, unpack(redis.call('HGETALL', KEYS[2]))}
""",
)

# KEYS: meta, members. ARGV: ttl_ms. Closes a group that went out (acknowledged, dropped, dead-lettered): its
# members record is deleted and the meta kept ttl_ms as a tombstone, so a member arriving later is late
# (GROUP_LATE), never a second group of the same id. Returns {DONE}.
GROUP_CLOSE_SCRIPT: Final = library_script(
    "group_close",
    """
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[1], 'closed', '1')
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return {$DONE}
""",
)

# KEYS: meta, members. ARGV: owner (the caller: consumer name / reader token), timeout_ms. A watched group's state:
# {GROUP_OWNED} / {GROUP_TAKEN, owner} (any other owner, idle or not: a dead owner's members come back through their
# idle receipt entries, to the gather) / {GROUP_WAIT} / {GROUP_GONE} (expired or closed), or
# {GROUP_COMPLETE | GROUP_SEALED, size, mismatch, members...} making the caller the owner: complete, or timed out.
GROUP_CHECK_SCRIPT: Final = library_script(
    "group_check",
    """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HGET', KEYS[1], 'closed') then return {$GROUP_GONE} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner == ARGV[1] then
  redis.call('HSET', KEYS[1], 'owner_at', now)
  return {$GROUP_OWNED}
end
if owner then
  return {$GROUP_TAKEN, owner}
end
local state = $GROUP_COMPLETE
local size = redis.call('HGET', KEYS[1], 'size')
if redis.call('HLEN', KEYS[2]) < tonumber(size) then
  if now - tonumber(redis.call('HGET', KEYS[1], 'first_at')) < tonumber(ARGV[2]) then return {$GROUP_WAIT} end
  state = $GROUP_SEALED
end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'owner_at', now)
redis.call('HINCRBY', KEYS[1], 'deliveries', 1)
return {state, size, redis.call('HGET', KEYS[1], 'mismatch') or '0', unpack(redis.call('HGETALL', KEYS[2]))}
""",
)
