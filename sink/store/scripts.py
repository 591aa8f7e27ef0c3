"""Every Lua script of the package, and :class:`ServerScript`, the one way they are loaded and run.

A script runs to completion before the server handles another command, and
every script touches only keys of one cluster slot (passed in ``KEYS``), so
each is atomic on that slot.

Reply convention: every script returns a table whose first element is an
integer status named by a constant of this module (the stage script, a batch,
returns one status per record instead); any payload follows the status. The
Lua text gets the numbers from the constants (``$NAME`` placeholders), so
Python and Lua cannot disagree.

Running: every script is a function of :data:`LIBRARY` (``FCALL`` on Redis >= 7.0 and Valkey, after
``staging-sink setup``), or ``EVALSHA`` on Redis 6.2; :mod:`sink.store.script_runner` decides per server.
A caller that pipelines (the sink's group commit) queues with :meth:`ServerScript.queue` and, on a
:meth:`ServerScript.missing` reply, calls :meth:`ServerScript.recover` and sends the pipeline again.
"""

from __future__ import annotations

from typing import Final

from sink.contract import record_schema
from sink.store.script_runner import ScriptLibrary, ServerScript

# The status codes live in script_status (re-exported here, beside the scripts that return them).
from sink.store.script_status import (
    APPEND_APPENDED,
    APPEND_CONFLICT,
    APPEND_DUPLICATE,
    APPEND_FENCED,
    CLAIM_CLAIMED,
    CLAIM_DUPLICATE,
    CLAIM_RETIRED,
    DELETE_STALE,
    DONE,
    GROUP_COMPLETE,
    GROUP_GONE,
    GROUP_OWNED,
    GROUP_SEALED,
    GROUP_TAKEN,
    GROUP_WAIT,
    LEDGER_FENCED,
    LEDGER_OPEN,
    NOT_REMOVED,
    REMOVED,
    STAGE_CONFLICT,
    STAGE_REPAIRED,
    STAGE_RETIRED,
    STAGE_SAME,
    STAGE_WRITTEN,
    STAGE_WRONG_TYPE,
    STATUS_CODES,
)

__all__ = (
    "APPEND_APPENDED",
    "APPEND_CONFLICT",
    "APPEND_DUPLICATE",
    "APPEND_FENCED",
    "APPEND_SCRIPT",
    "CALLS_ENTRY_FIELDS",
    "CLAIM_CLAIMED",
    "CLAIM_DUPLICATE",
    "CLAIM_RETIRED",
    "CLAIM_SCRIPT",
    "CLEAR_SCRIPT",
    "DELETE_STALE",
    "DONE",
    "GROUP_CHECK_SCRIPT",
    "GROUP_COMPLETE",
    "GROUP_GATHER_SCRIPT",
    "GROUP_GONE",
    "GROUP_OWNED",
    "GROUP_SEALED",
    "GROUP_TAKEN",
    "GROUP_WAIT",
    "HAS_ROWS_SCRIPT",
    "LEDGER_DELETE_SCRIPT",
    "LEDGER_FENCED",
    "LEDGER_OPEN",
    "LEDGER_RETIRE_SCRIPT",
    "LIBRARY",
    "NOT_REMOVED",
    "READ_SCRIPT",
    "RELEASE_SCRIPT",
    "REMOVED",
    "RETIRE_CONSUMER_SCRIPT",
    "STAGE_CONFLICT",
    "STAGE_REPAIRED",
    "STAGE_RETIRED",
    "STAGE_SAME",
    "STAGE_SCRIPT",
    "STAGE_WRITTEN",
    "STAGE_WRONG_TYPE",
    "TOUCH_SCRIPT",
    "ServerScript",
)


# Field names of one token-free entry in ns:{R}:calls, in ARGV order (from the record field table).
CALLS_ENTRY_FIELDS: Final = record_schema.CALLS_ENTRY_FIELDS


LIBRARY: Final = ScriptLibrary("staging_sink")
"""Every script below, as one function library (see :mod:`sink.store.script_runner`)."""


def _script(name: str, template: str, **extra: str) -> ServerScript:
    return LIBRARY.script(name, template, codes=STATUS_CODES, **extra)


# --- staging (sink.store.sink) -----------------------------------------------------------

# One call stages a batch of records of one cluster slot (one server: any
# records). For each record it either stores the blob and appends its
# token-free entry to the rollout's ``calls`` stream, or, when the key already
# holds a record, compares digests without writing. Every check that could make
# a write fail (wrong key types) runs in a first pass, before any write, so an
# error can never leave a record without its ``calls`` entry or the reverse.
#
# A rollout whose retire fence is set (consumed, or retired by an operator) refuses
# the write: a late stage must not leave records that nothing would ever delete.
#
# KEYS: rec_1, calls_1, fence_1, rec_2, calls_2, fence_2, ...
# ARGV: head_bytes, rewrite_present ('1' or '0'), then per record: digest, blob, then the values of
# CALLS_ENTRY_FIELDS. The codec places the digest inside the first head_bytes
# bytes of every blob, so an existing record's digest is compared with
# GETRANGE instead of transferring the whole record; only when it matches is the whole
# stored blob compared (inside the server) with the new one. Returns one status per record.
_STAGE = """
local field_names = {$FIELDS}
local nfields = #field_names
local head_len = tonumber(ARGV[1])
local rewrite_present = ARGV[2] == '1'
local per = 2 + nfields
local n = #KEYS / 3
local status = {}
-- pass 1, no writes: anything that could fail a write fails here
for i = 1, n do
  local rec_type = redis.call('TYPE', KEYS[3 * i - 2])['ok']
  local calls_type = redis.call('TYPE', KEYS[3 * i - 1])['ok']
  if (rec_type ~= 'none' and rec_type ~= 'string') or (calls_type ~= 'none' and calls_type ~= 'stream') then
    status[i] = $STAGE_WRONG_TYPE
  elseif redis.call('EXISTS', KEYS[3 * i]) == 1 then
    status[i] = $STAGE_RETIRED
  end
end
-- pass 2: write absent records with their calls entry; compare present ones
for i = 1, n do
  if status[i] == nil then
    local base = 2 + (i - 1) * per
    local digest = ARGV[base + 1]
    local head = redis.call('GETRANGE', KEYS[3 * i - 2], 0, head_len - 1)
    if head == '' then
      redis.call('SET', KEYS[3 * i - 2], ARGV[base + 2])
      local entry = {}
      for f = 1, nfields do
        entry[2 * f - 1] = field_names[f]
        entry[2 * f] = ARGV[base + 2 + f]
      end
      redis.call('XADD', KEYS[3 * i - 1], '*', unpack(entry))
      status[i] = $STAGE_WRITTEN
    elseif string.find(head, digest, 1, true) then
      local blob = ARGV[base + 2]
      if redis.call('STRLEN', KEYS[3 * i - 2]) ~= #blob or redis.call('GET', KEYS[3 * i - 2]) ~= blob then
        -- Same digest, other bytes: the stored blob no longer matches its digest
        -- (the new blob was validated before it was sent). Repair it.
        redis.call('SET', KEYS[3 * i - 2], blob)
        status[i] = $STAGE_REPAIRED
      else
        -- Same record. When replicas must confirm, write it again (same content by
        -- digest) so this connection's WAIT covers a write the replica must have,
        -- not just whatever this connection wrote last.
        if rewrite_present then
          redis.call('SET', KEYS[3 * i - 2], blob)
        end
        status[i] = $STAGE_SAME
      end
    else
      status[i] = $STAGE_CONFLICT
    end
  end
end
return status
"""
STAGE_SCRIPT: Final = _script("stage", _STAGE, FIELDS=", ".join(f"'{name}'" for name in CALLS_ENTRY_FIELDS))

# KEYS: calls stream, then the record keys; ARGV: the staging keys, same order.
# Deletes the records and the calls entries naming them; drops an emptied stream.
# Returns {DONE, how many records existed}.
CLEAR_SCRIPT: Final = _script(
    "clear",
    """
local removed = 0
local doomed = {}
for i = 2, #KEYS do
  removed = removed + redis.call('DEL', KEYS[i])
  doomed[ARGV[i - 1]] = true
end
if redis.call('TYPE', KEYS[1])['ok'] == 'stream' then
  local entries = redis.call('XRANGE', KEYS[1], '-', '+')
  for _, entry in ipairs(entries) do
    local fields = entry[2]
    for f = 1, #fields, 2 do
      if fields[f] == 'key' and doomed[fields[f + 1]] then
        redis.call('XDEL', KEYS[1], entry[1])
      end
    end
  end
  if redis.call('XLEN', KEYS[1]) == 0 then
    redis.call('DEL', KEYS[1])
  end
end
return {$DONE, removed}
""",
)

# --- the capture ledger (sink.ledger.redis) ----------------------------------------------
# Every ledger script touches only the keys of one rollout (ns:{R}:ledger,
# ns:{R}:ledger:ids, ns:{R}:fence), all sharing the hash tag {R}: nothing can
# land between the fence check and the write, or between fencing and removal.

# KEYS: ledger stream, ids hash, fence.
# ARGV: idempotency field, its value, then the stream entry's field/value pairs.
# Returns {APPEND_APPENDED}, {APPEND_DUPLICATE} (identical row), {APPEND_FENCED}
# (discarded) or {APPEND_CONFLICT, stored_value} (nothing written).
APPEND_SCRIPT: Final = _script(
    "append",
    """
if redis.call('EXISTS', KEYS[3]) == 1 then
  return {$APPEND_FENCED}
end
local stored = redis.call('HGET', KEYS[2], ARGV[1])
if stored then
  if stored == ARGV[2] then
    return {$APPEND_DUPLICATE}
  end
  return {$APPEND_CONFLICT, stored}
end
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return {$APPEND_APPENDED}
""",
)

# KEYS: ledger stream, fence. Returns {LEDGER_FENCED} or {LEDGER_OPEN, XRANGE - +}.
READ_SCRIPT: Final = _script(
    "read",
    """
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {$LEDGER_FENCED}
end
return {$LEDGER_OPEN, redis.call('XRANGE', KEYS[1], '-', '+')}
""",
)

# KEYS: ledger stream, fence. Returns {LEDGER_FENCED} or {LEDGER_OPEN, 1 if any row else 0}.
HAS_ROWS_SCRIPT: Final = _script(
    "has_rows",
    """
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {$LEDGER_FENCED}
end
return {$LEDGER_OPEN, redis.call('EXISTS', KEYS[1])}
""",
)

# KEYS: ledger stream, ids hash, fence. ARGV: fence value.
# Returns {REMOVED} when a live ledger was removed, {NOT_REMOVED} otherwise
# (never started or already retired). Either way the fence is in place afterwards.
# One DEL per key: the generated ACL grants DEL on each key kind in its own
# selector, and a multi-key DEL must be allowed by one selector for all its keys.
LEDGER_RETIRE_SCRIPT: Final = _script(
    "retire",
    """
local had_rows = 0
if redis.call('EXISTS', KEYS[3]) == 0 then
  had_rows = redis.call('EXISTS', KEYS[1])
end
redis.call('DEL', KEYS[1])
redis.call('DEL', KEYS[2])
if redis.call('EXISTS', KEYS[3]) == 0 then
  redis.call('SET', KEYS[3], ARGV[1])
end
if had_rows == 1 then return {$REMOVED} end
return {$NOT_REMOVED}
""",
)

# Deleting a rollout makes its id reusable (contract §6.9): every key under its hash tag goes, in one
# script, one DEL per key (see above).
# KEYS: ledger stream, ids hash, fence, receipt, claim, calls stream, then the record keys the calls
# stream named when the caller read it. ARGV: how many entries the calls stream had then.
# Returns {DELETE_STALE} (nothing changed: a record was staged since; read the calls stream again),
# or {REMOVED} when a live ledger was removed, {NOT_REMOVED} otherwise.
LEDGER_DELETE_SCRIPT: Final = _script(
    "delete",
    """
local calls = 0
if redis.call('TYPE', KEYS[6])['ok'] == 'stream' then calls = redis.call('XLEN', KEYS[6]) end
if calls ~= tonumber(ARGV[1]) then return {$DELETE_STALE} end
local had_rows = redis.call('EXISTS', KEYS[1])
for i = 1, #KEYS do
  redis.call('DEL', KEYS[i])
end
if had_rows == 1 then return {$REMOVED} end
return {$NOT_REMOVED}
""",
)

# --- consumer groups (sink.store.streams) ------------------------------------------------

# KEYS: the stream; ARGV: group, consumer, ids. Resets the idle time of the ids
# this consumer still owns (XCLAIM ... JUSTID keeps the delivery count).
# Returns {DONE, ids it no longer owns...} (reclaimed by another consumer, or acked).
TOUCH_SCRIPT: Final = _script(
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

# KEYS: the stream; ARGV: group, consumer. Deletes the consumer only when it
# owns no pending entry (deleting it would drop them from the PEL).
# Returns {REMOVED} or {NOT_REMOVED}.
RETIRE_CONSUMER_SCRIPT: Final = _script(
    "retire_consumer",
    """
if redis.call('EXISTS', KEYS[1]) == 0 then return {$NOT_REMOVED} end
local p = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if #p > 0 then return {$NOT_REMOVED} end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return {$REMOVED}
""",
)

# --- rollout claims (sink.trainer.reader) --------------------------------------------------------

# KEYS: claim key, fence key; ARGV: token (stream#entry id), consumer, check fence ('1'/'0').
# Returns {status, the claim's previous value or ''}: CLAIM_RETIRED (the ledger was
# retired, so the rollout was consumed or given up already), CLAIM_DUPLICATE
# (another receipt entry owns the rollout) or CLAIM_CLAIMED (ours: new, or taken over).
CLAIM_SCRIPT: Final = _script(
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
RELEASE_SCRIPT: Final = _script(
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

# KEYS: meta, members. ARGV: member id, member record, consumer, size, claim_idle_ms, ttl_ms.
# Records the member, then: {GROUP_COMPLETE, members...} when this call completes the group (or finds it complete
# with no live owner) and makes the caller its owner (meta 'deliveries' counts the owners it had: above 1, the
# group was delivered before); {GROUP_OWNED} when the caller owns it already;
# {GROUP_TAKEN, owner} when a live rank owns it; {GROUP_WAIT} otherwise.
GROUP_GATHER_SCRIPT: Final = _script(
    "group_gather",
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('HSETNX', KEYS[1], 'size', ARGV[4]) == 1 then redis.call('HSET', KEYS[1], 'first_at', now) end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
redis.call('PEXPIRE', KEYS[2], ARGV[6])
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner == ARGV[3] then return {$GROUP_OWNED} end
if owner and now - tonumber(redis.call('HGET', KEYS[1], 'owner_at')) < tonumber(ARGV[5]) then
  return {$GROUP_TAKEN, owner}
end
if redis.call('HLEN', KEYS[2]) < tonumber(redis.call('HGET', KEYS[1], 'size')) then return {$GROUP_WAIT} end
redis.call('HSET', KEYS[1], 'owner', ARGV[3], 'owner_at', now)
redis.call('HINCRBY', KEYS[1], 'deliveries', 1)
return {$GROUP_COMPLETE, unpack(redis.call('HGETALL', KEYS[2]))}
""",
)

# KEYS: meta, members. ARGV: consumer, timeout_ms, claim_idle_ms.
# A watched group's state: {GROUP_OWNED} / {GROUP_TAKEN, owner} / {GROUP_WAIT} / {GROUP_GONE} (expired or
# acknowledged), or {GROUP_COMPLETE | GROUP_SEALED, members...} making the caller the owner: complete (an owner
# died) or timed out.
GROUP_CHECK_SCRIPT: Final = _script(
    "group_check",
    """
if redis.call('EXISTS', KEYS[1]) == 0 then return {$GROUP_GONE} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner == ARGV[1] then
  redis.call('HSET', KEYS[1], 'owner_at', now)
  return {$GROUP_OWNED}
end
if owner and now - tonumber(redis.call('HGET', KEYS[1], 'owner_at')) < tonumber(ARGV[3]) then
  return {$GROUP_TAKEN, owner}
end
local state = $GROUP_COMPLETE
if redis.call('HLEN', KEYS[2]) < tonumber(redis.call('HGET', KEYS[1], 'size')) then
  if now - tonumber(redis.call('HGET', KEYS[1], 'first_at')) < tonumber(ARGV[2]) then return {$GROUP_WAIT} end
  state = $GROUP_SEALED
end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'owner_at', now)
redis.call('HINCRBY', KEYS[1], 'deliveries', 1)
return {state, unpack(redis.call('HGETALL', KEYS[2]))}
""",
)
