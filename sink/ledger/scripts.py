"""Lua scripts of the Redis capture ledger.

Every script touches only the keys of one rollout (``ns:{R}:ledger``,
``ns:{R}:ledger:ids``, ``ns:{R}:fence``), all passed in ``KEYS`` and sharing the
hash tag ``{R}``, so each runs atomically on one cluster slot. A script runs
to completion before the server handles another command: nothing can land
between the fence check and the write, or between fencing and removal.
"""

from __future__ import annotations

__all__ = (
    "APPEND_APPENDED",
    "APPEND_CONFLICT",
    "APPEND_DUPLICATE",
    "APPEND_FENCED",
    "APPEND_SCRIPT",
    "DELETE_SCRIPT",
    "HAS_ROWS_SCRIPT",
    "READ_SCRIPT",
    "RETIRE_SCRIPT",
)

APPEND_APPENDED = 0
APPEND_DUPLICATE = 1
APPEND_FENCED = 2
APPEND_CONFLICT = 3

# KEYS: ledger stream, ids hash, fence.
# ARGV: idempotency field, its value, then the stream entry's field/value pairs.
# Returns {0} appended, {1} identical duplicate, {2} fenced (discarded),
# {3, stored_value} conflicting row (nothing written).
APPEND_SCRIPT = """
if redis.call('EXISTS', KEYS[3]) == 1 then
  return {2}
end
local stored = redis.call('HGET', KEYS[2], ARGV[1])
if stored then
  if stored == ARGV[2] then
    return {1}
  end
  return {3, stored}
end
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return {0}
"""

# KEYS: ledger stream, fence. Returns {1} when fenced, else {0, XRANGE - +}.
READ_SCRIPT = """
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {1}
end
return {0, redis.call('XRANGE', KEYS[1], '-', '+')}
"""

# KEYS: ledger stream, fence. Returns {1} when fenced, else {0, 1 if any row}.
HAS_ROWS_SCRIPT = """
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {1}
end
return {0, redis.call('EXISTS', KEYS[1])}
"""

# KEYS: ledger stream, ids hash, fence. ARGV: fence value.
# Returns 1 when a live ledger was removed, 0 otherwise (never started or
# already retired). Either way the fence is in place afterwards.
RETIRE_SCRIPT = """
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('DEL', KEYS[1], KEYS[2])
  return 0
end
redis.call('SET', KEYS[3], ARGV[1])
local had_rows = redis.call('EXISTS', KEYS[1])
redis.call('DEL', KEYS[1], KEYS[2])
return had_rows
"""

# KEYS: ledger stream, ids hash, fence. Returns 1 when a live ledger was removed.
DELETE_SCRIPT = """
local had_rows = redis.call('EXISTS', KEYS[1])
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return had_rows
"""
