"""The Lua scripts that write staged records and ledgers (the sink and the ledger); see :mod:`sink.store.scripts`."""

from __future__ import annotations

from typing import Final

from sink.contract import record_schema
from sink.store.scripts.status import library_script

__all__ = (
    "APPEND_AFTER_STAGE_SCRIPT",
    "APPEND_SCRIPT",
    "CALLS_ENTRY_FIELDS",
    "CLEAR_SCRIPT",
    "HAS_ROWS_SCRIPT",
    "LEDGER_DELETE_SCRIPT",
    "LEDGER_RETIRE_SCRIPT",
    "READ_SCRIPT",
    "STAGE_SCRIPT",
)

# Field names of one token-free entry in ns:{R}:calls, in ARGV order (from the record field table).
CALLS_ENTRY_FIELDS: Final = record_schema.CALLS_ENTRY_FIELDS


# --- staging (sink.store.sink) -----------------------------------------------------------

# One call stages a batch of records of one cluster slot (one server: any
# records). The record blobs never pass through Lua: the writer sends each blob
# with a plain ``SET`` to an *incoming* key of the record's slot
# (:func:`sink.keys.incoming_key`), in the same ``MULTI``/``EXEC`` as this
# script, and the script moves it into place with ``RENAME`` (no copy) or
# deletes it. So the server's cost of a stage is a SET's plus this script's
# work on keys and small arguments, whatever the record's size, and no other
# client ever sees an incoming key (the transaction is atomic).
#
# For each record it either moves the blob into place and appends its
# token-free entry to the rollout's ``calls`` stream, or, when the key already
# holds a record, compares digests without writing. Every check that could make
# a write fail (wrong key types) runs in a first pass, before any write, so an
# error can never leave a record without its ``calls`` entry or the reverse.
#
# A rollout whose retire fence is set (consumed, or retired by an operator) refuses
# the write: a late stage must not leave records that nothing would ever delete.
#
# KEYS: rec_1, calls_1, fence_1, incoming_1, rec_2, ...
# ARGV: head_bytes, then per record: digest, then the values of
# CALLS_ENTRY_FIELDS. The codec places the digest inside the first head_bytes
# bytes of every blob, so an existing record's digest is compared with
# GETRANGE instead of reading the whole record; only when it matches is the whole
# stored blob compared with the incoming one (a re-stage: the only path that reads a blob).
# The incoming key carries an expiry (set by the writer) that a moved record must not keep: PERSIST.
# Every incoming key is gone when the script returns. Returns one status per record.
_STAGE = """
local field_names = {$FIELDS}
local nfields = #field_names
local head_len = tonumber(ARGV[1])
local per = 1 + nfields
local n = #KEYS / 4
local status = {}
local function move_in(i)
  redis.call('RENAME', KEYS[4 * i], KEYS[4 * i - 3])
  redis.call('PERSIST', KEYS[4 * i - 3])
end
-- pass 1, no writes: anything that could fail a write fails here
for i = 1, n do
  local rec_type = redis.call('TYPE', KEYS[4 * i - 3])['ok']
  local calls_type = redis.call('TYPE', KEYS[4 * i - 2])['ok']
  if (rec_type ~= 'none' and rec_type ~= 'string') or (calls_type ~= 'none' and calls_type ~= 'stream')
      or redis.call('TYPE', KEYS[4 * i])['ok'] ~= 'string' then
    status[i] = $STAGE_WRONG_TYPE
  elseif redis.call('EXISTS', KEYS[4 * i - 1]) == 1 then
    status[i] = $STAGE_RETIRED
  end
end
-- pass 2: move absent records in with their calls entry; compare present ones
for i = 1, n do
  if status[i] == nil then
    local base = 1 + (i - 1) * per
    local digest = ARGV[base + 1]
    local head = redis.call('GETRANGE', KEYS[4 * i - 3], 0, head_len - 1)
    if head == '' then
      move_in(i)
      local entry = {}
      for f = 1, nfields do
        entry[2 * f - 1] = field_names[f]
        entry[2 * f] = ARGV[base + 1 + f]
      end
      redis.call('XADD', KEYS[4 * i - 2], '*', unpack(entry))
      status[i] = $STAGE_WRITTEN
    elseif string.find(head, digest, 1, true) then
      if redis.call('STRLEN', KEYS[4 * i - 3]) ~= redis.call('STRLEN', KEYS[4 * i])
          or redis.call('GET', KEYS[4 * i - 3]) ~= redis.call('GET', KEYS[4 * i]) then
        -- Same digest, other bytes: the stored blob no longer matches its digest
        -- (the new blob was validated before it was sent). Repair it.
        move_in(i)
        status[i] = $STAGE_REPAIRED
      else
        -- Same record: left as it is. This transaction wrote (the incoming value, then its
        -- deletion), so this connection's WAIT and WAITAOF cover a write made after the
        -- record's, which a replica or the AOF cannot hold without the record.
        status[i] = $STAGE_SAME
      end
    else
      status[i] = $STAGE_CONFLICT
    end
  end
end
-- the incoming blobs not moved in (refused, same, conflicting) go
for i = 1, n do
  redis.call('DEL', KEYS[4 * i])
end
return status
"""
STAGE_SCRIPT: Final = library_script("stage", _STAGE, FIELDS=", ".join(f"'{name}'" for name in CALLS_ENTRY_FIELDS))

# KEYS: calls stream, then the record keys; ARGV: the staging keys, same order.
# Deletes the records and the calls entries naming them; drops an emptied stream.
# Returns {DONE, how many records existed}.
CLEAR_SCRIPT: Final = library_script(
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

# The append of one row, after the fence check: ARGV[first] is the idempotency field, then its value, then the
# stream entry's field/value pairs.
def _append_body(first: int) -> str:
    field, value, entry = first, first + 1, first + 2
    return f"""
local stored = redis.call('HGET', KEYS[2], ARGV[{field}])
if stored then
  if stored == ARGV[{value}] then
    return {{$APPEND_DUPLICATE}}
  end
  return {{$APPEND_CONFLICT, stored}}
end
redis.call('XADD', KEYS[1], '*', unpack(ARGV, {entry}))
redis.call('HSET', KEYS[2], ARGV[{field}], ARGV[{value}])
return {{$APPEND_APPENDED}}
"""


_FENCE_CHECK = """
if redis.call('EXISTS', KEYS[3]) == 1 then
  return {$APPEND_FENCED}
end
"""

# KEYS: ledger stream, ids hash, fence.
# ARGV: idempotency field, its value, then the stream entry's field/value pairs.
# Returns {APPEND_APPENDED}, {APPEND_DUPLICATE} (identical row), {APPEND_FENCED}
# (discarded) or {APPEND_CONFLICT, stored_value} (nothing written).
APPEND_SCRIPT: Final = library_script("append", _FENCE_CHECK + _append_body(1))

# The custody row of a call sent right behind its stage, in the same round trip (contract §6.6, one durable round):
# appended only when the record it names is stored under its key with its digest, which the stage just wrote (or
# found already there); a stage that did not write it (a conflicting record, a refusal, an error) leaves the ledger
# unchanged, and the gate then commits as it would have without the shared round.
# KEYS: ledger stream, ids hash, fence, the row's record key.
# ARGV: head_bytes, the row's digest, then APPEND_SCRIPT's ARGV.
# Returns APPEND_SCRIPT's replies, or {APPEND_NOT_STAGED} (nothing written).
APPEND_AFTER_STAGE_SCRIPT: Final = library_script(
    "append_after_stage",
    _FENCE_CHECK
    + """
if redis.call('TYPE', KEYS[4])['ok'] ~= 'string'
    or not string.find(redis.call('GETRANGE', KEYS[4], 0, tonumber(ARGV[1]) - 1), ARGV[2], 1, true) then
  return {$APPEND_NOT_STAGED}
end
"""
    + _append_body(3),
)

# KEYS: ledger stream, fence. Returns {LEDGER_FENCED} or {LEDGER_OPEN, XRANGE - +}.
READ_SCRIPT: Final = library_script(
    "read",
    """
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {$LEDGER_FENCED}
end
return {$LEDGER_OPEN, redis.call('XRANGE', KEYS[1], '-', '+')}
""",
)

# KEYS: ledger stream, fence. Returns {LEDGER_FENCED} or {LEDGER_OPEN, 1 if any row else 0}.
HAS_ROWS_SCRIPT: Final = library_script(
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
LEDGER_RETIRE_SCRIPT: Final = library_script(
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
LEDGER_DELETE_SCRIPT: Final = library_script(
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
