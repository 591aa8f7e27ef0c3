"""The Lua scripts of the consumer side: consumer groups, rollout claims, GRPO groups; see :mod:`sink.store.scripts`."""

from __future__ import annotations

from typing import Final

from sink.store.scripts.status import GroupStatus, library_script

__all__ = (
    "CLAIM_SCRIPT",
    "GIVE_BACK_SCRIPT",
    "GROUP_CLOSE_SCRIPT",
    "GROUP_DUE_SCRIPT",
    "GROUP_RECORD_SCRIPT",
    "GROUP_SEAL_SCRIPT",
    "GROUP_TAKE_SCRIPT",
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


# --- GRPO groups (sink.rollout.assembler gathers them; sink.trainer reads them) ----------------------------------

# The group record (one slot, {grp:<id>}): meta (size, first_at, mismatch, tombstone_ms, then state once frozen:
# 'complete' or 'sealed', published once its entry is on a receipts stream, closed once a rank consumed it) and
# members (rollout id -> the member's receipts entry fields). A frozen group's members hash is its member set.
# A frozen or published reply is {state, size, mismatch, first_at, member ids...}.

# The reply of a group whose member set is frozen and not yet published, the one shape both scripts below return
# (the Lua local `state` holds 'complete' or 'sealed'): {GROUP_COMPLETE | GROUP_SEALED, size, mismatch, first_at,
# member ids...}.
_FROZEN_REPLY: Final = f"""local meta = redis.call('HMGET', KEYS[1], 'size', 'mismatch', 'first_at')
local code = {int(GroupStatus.SEALED)}
if state == 'complete' then code = {int(GroupStatus.COMPLETE)} end
return {{code, meta[1], meta[2], meta[3], unpack(redis.call('HKEYS', KEYS[2]))}}"""

# KEYS: meta, members. ARGV: member id, member fields, size announced, tombstone_ms. Records a member.
# {GROUP_LATE} (nothing recorded): the group was frozen without it. {GROUP_PUBLISHED}: the member is in a frozen set
# already published (a redo). {GROUP_OPEN, first_at}: recorded, not complete. {GROUP_COMPLETE, ...} / {GROUP_SEALED,
# ...}: this call completed the group (its member set now frozen), or a redo found it frozen and not yet published.
# Sizes that disagree keep the largest and set 'mismatch'.
GROUP_RECORD_SCRIPT: Final = library_script(
    "group_record",
    """
local state = redis.call('HGET', KEYS[1], 'state')
if state then
  if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then return {$GROUP_LATE} end
  if redis.call('HGET', KEYS[1], 'published') then return {$GROUP_PUBLISHED} end
else
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if redis.call('HSETNX', KEYS[1], 'size', ARGV[3]) == 1 then
    redis.call('HSET', KEYS[1], 'first_at', now, 'mismatch', '0', 'tombstone_ms', ARGV[4])
  elseif tonumber(redis.call('HGET', KEYS[1], 'size')) ~= tonumber(ARGV[3]) then
    redis.call('HSET', KEYS[1], 'mismatch', '1')
    if tonumber(ARGV[3]) > tonumber(redis.call('HGET', KEYS[1], 'size')) then redis.call('HSET', KEYS[1], 'size', ARGV[3]) end
  end
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
  if redis.call('HLEN', KEYS[2]) < tonumber(redis.call('HGET', KEYS[1], 'size')) then
    return {$GROUP_OPEN, redis.call('HGET', KEYS[1], 'first_at')}
  end
  state = 'complete'
  redis.call('HSET', KEYS[1], 'state', state)
end
$FROZEN_REPLY
""",
    FROZEN_REPLY=_FROZEN_REPLY,
)

# KEYS: meta, members. ARGV: timeout_ms. A timeout sweep's step for one open group: {GROUP_GONE} (no record),
# {GROUP_PUBLISHED}, {GROUP_OPEN, first_at} (not due yet), or {GROUP_COMPLETE | GROUP_SEALED, ...}: frozen and not
# yet published (frozen here as sealed when it was open past timeout_ms).
GROUP_SEAL_SCRIPT: Final = library_script(
    "group_seal",
    """
if redis.call('EXISTS', KEYS[1]) == 0 then return {$GROUP_GONE} end
if redis.call('HGET', KEYS[1], 'published') then return {$GROUP_PUBLISHED} end
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local first_at = redis.call('HGET', KEYS[1], 'first_at')
  if now - tonumber(first_at) < tonumber(ARGV[1]) then return {$GROUP_OPEN, first_at} end
  state = 'sealed'
  redis.call('HSET', KEYS[1], 'state', state)
end
$FROZEN_REPLY
""",
    FROZEN_REPLY=_FROZEN_REPLY,
)

# KEYS: the open-groups index of one done shard (zset: group id by first_at). ARGV: timeout_ms, count.
# Returns {open groups in the index, ids of up to count groups opened timeout_ms ago or earlier...}.
GROUP_DUE_SCRIPT: Final = library_script(
    "group_due",
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[1]), 'LIMIT', 0, tonumber(ARGV[2]))
return {redis.call('ZCARD', KEYS[1]), unpack(due)}
""",
)

# KEYS: meta, members. ARGV: the group entry's token (stream#entry id), then the member ids it names. A reader's
# claim of a whole group for one of its entries (a group published twice has two), before it claims the members:
# {CLAIM_DUPLICATE} when another entry claimed the group; {CLAIM_RETIRED} when the group was consumed (closed) or
# its record is gone; else the group is this entry's (new, or taken over with the entry) and the reply is
# {CLAIM_CLAIMED, each member's fields or false...}.
GROUP_TAKE_SCRIPT: Final = library_script(
    "group_take",
    """
local owner = redis.call('HGET', KEYS[1], 'claimed')
if owner and owner ~= ARGV[1] then return {$CLAIM_DUPLICATE} end
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HGET', KEYS[1], 'closed') then return {$CLAIM_RETIRED} end
redis.call('HSET', KEYS[1], 'claimed', ARGV[1])
return {$CLAIM_CLAIMED, unpack(redis.call('HMGET', KEYS[2], unpack(ARGV, 2)))}
""",
)

# KEYS: meta, members. ARGV: ttl_ms. Closes a group a rank consumed (its entry's last member acknowledged): both keys
# expire after the longer of ttl_ms and the tombstone_ms the assembler stamped, the meta a tombstone (frozen: a
# member arriving later is late, never a second group of the same id). Returns {DONE}.
GROUP_CLOSE_SCRIPT: Final = library_script(
    "group_close",
    """
local ttl = tonumber(ARGV[1])
local own = tonumber(redis.call('HGET', KEYS[1], 'tombstone_ms') or '0')
if own > ttl then ttl = own end
redis.call('HSET', KEYS[1], 'closed', '1')
if not redis.call('HGET', KEYS[1], 'state') then redis.call('HSET', KEYS[1], 'state', 'sealed') end
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
return {$DONE}
""",
)
