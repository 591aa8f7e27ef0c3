"""The NeMo Gym transport's one Lua script, ``GYM_SCRIPT`` (its status codes are
:class:`~sink.store.script_status.GymStatus`; re-exported by :mod:`sink.store.scripts`, whose import registers
every script in the one library).

The script runs a batch of operations, each on the keys of one rollout, all of one cluster slot (the
group commit in :mod:`sink.store.commit` queues it like the staging script). Per rollout ``R``:

=========================  ======  ============================================================
key                        type    holds
=========================  ======  ============================================================
``ns:{R}:gym``             hash    ``version``, ``frozen``, ``incomplete``, ``snapshot_id``, ``touched_ms``
``ns:{R}:gym:entries``     hash    ``model_call_id`` -> encoded entry (:mod:`sink.gym.codec`)
``ns:{R}:gym:digests``     hash    ``model_call_id`` -> the entry's digest (identity of its payload)
``ns:{R}:gym:intents``     set     the call ids ``begin_call`` announced
``ns:{R}:fence``           string  the rollout's retire fence (here: the tombstone of a dropped snapshot)
=========================  ======  ============================================================

KEYS: per operation those five keys, in that order. ARGV: ``retention_ms``, ``rewrite`` (``'1'`` when
replicas must confirm: an identical put writes its digest again so this connection's ``WAIT`` covers it),
then per operation four values ``op, a1, a2, a3``:

* ``put, call_id, digest, blob`` -> ``{GYM_OK}`` written, ``{GYM_SAME}``, ``{GYM_CONFLICT}`` (the rollout
  is marked incomplete, nothing else written), ``{GYM_FROZEN}`` or ``{GYM_RETIRED}``;
* ``mark, call_id`` -> ``{GYM_OK, version}`` or ``{GYM_RETIRED}``;
* ``begin, call_id`` -> ``{GYM_OK}``, ``{GYM_FROZEN}`` or ``{GYM_RETIRED}``;
* ``freeze, new_snapshot_id`` -> ``{GYM_OK, snapshot_id, version, incomplete}`` or ``{GYM_RETIRED}``; the
  entries are read with a plain ``HVALS`` right after the script in the same round trip (a frozen rollout's
  entries no longer change, and copying megabytes through a Lua table costs more than the read itself);
* ``drop, snapshot_id, version`` -> ``{GYM_OK}`` (dropped now, or dropped before with this identity) or
  ``{GYM_DROP_REFUSED}`` (nothing deleted).

Any operation meeting a key of the wrong type gets ``{GYM_WRONG_TYPE}`` from a first pass that writes
nothing. ``version`` counts every change a consumer could care about (a new entry, a conflict, a mark, the
freeze); an identical put, a ``begin`` and a repeated freeze leave it alone.
"""

from __future__ import annotations

from typing import Final

from sink.store.script_status import library_script

__all__ = (
    "GYM_KEYS_PER_OP",
    "GYM_LUA",
    "GYM_SCRIPT",
    "TOMBSTONE_PREFIX",
)

GYM_KEYS_PER_OP: Final = 5

TOMBSTONE_PREFIX: Final = "gym-drop "
"""The fence value a drop leaves: this prefix, then ``<snapshot_id>:<version>`` (a repeated drop matches it)."""

GYM_LUA: Final = """
local retention_ms = tonumber(ARGV[1])
local rewrite = ARGV[2] == '1'
local n = #KEYS / 5
local replies = {}
local expected = {'hash', 'hash', 'hash', 'set', 'string'}
-- pass 1, no writes: a key of the wrong type fails its operation here
for i = 1, n do
  for k = 1, 5 do
    local t = redis.call('TYPE', KEYS[5 * (i - 1) + k])['ok']
    if t ~= 'none' and t ~= expected[k] then
      replies[i] = {$GYM_WRONG_TYPE}
      break
    end
  end
end
local t = redis.call('TIME')
local now_ms = tostring(tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
local function changed(state)
  redis.call('HSET', state, 'touched_ms', now_ms)
  return redis.call('HINCRBY', state, 'version', 1)
end
-- pass 2, in queue order
for i = 1, n do
  if replies[i] == nil then
    local b = 5 * (i - 1)
    local state, entries, digests, intents, fence = KEYS[b + 1], KEYS[b + 2], KEYS[b + 3], KEYS[b + 4], KEYS[b + 5]
    local a = 2 + 4 * (i - 1)
    local op, a1, a2, a3 = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4]
    if op == 'drop' then
      local tomb = redis.call('GET', fence)
      local identity = '$TOMBSTONE_PREFIX' .. a1 .. ':' .. a2
      if tomb then
        if tomb == identity then replies[i] = {$GYM_OK} else replies[i] = {$GYM_DROP_REFUSED} end
      elseif redis.call('HGET', state, 'frozen') == '1' and redis.call('HGET', state, 'snapshot_id') == a1
          and redis.call('HGET', state, 'version') == a2 then
        redis.call('DEL', state)
        redis.call('DEL', entries)
        redis.call('DEL', digests)
        redis.call('DEL', intents)
        redis.call('SET', fence, identity, 'PX', retention_ms)
        replies[i] = {$GYM_OK}
      else
        replies[i] = {$GYM_DROP_REFUSED}
      end
    elseif redis.call('EXISTS', fence) == 1 then
      replies[i] = {$GYM_RETIRED}
    elseif op == 'put' then
      if redis.call('HGET', state, 'frozen') == '1' then
        replies[i] = {$GYM_FROZEN}
      else
        local stored = redis.call('HGET', digests, a1)
        if not stored then
          redis.call('HSET', entries, a1, a3)
          redis.call('HSET', digests, a1, a2)
          changed(state)
          replies[i] = {$GYM_OK}
        elseif stored == a2 then
          if rewrite then redis.call('HSET', digests, a1, a2) end
          replies[i] = {$GYM_SAME}
        else
          redis.call('HSET', state, 'incomplete', '1')
          changed(state)
          replies[i] = {$GYM_CONFLICT}
        end
      end
    elseif op == 'mark' then
      redis.call('HSET', state, 'incomplete', '1')
      replies[i] = {$GYM_OK, changed(state)}
    elseif op == 'begin' then
      if redis.call('HGET', state, 'frozen') == '1' then
        replies[i] = {$GYM_FROZEN}
      else
        redis.call('SADD', intents, a1)
        redis.call('HSETNX', state, 'version', 0)
        redis.call('HSET', state, 'touched_ms', now_ms)
        replies[i] = {$GYM_OK}
      end
    elseif op == 'freeze' then
      if redis.call('HGET', state, 'frozen') ~= '1' then
        local incomplete = redis.call('HGET', state, 'incomplete') == '1'
        if not incomplete then
          for _, call_id in ipairs(redis.call('SMEMBERS', intents)) do
            if redis.call('HEXISTS', digests, call_id) == 0 then
              incomplete = true
              break
            end
          end
        end
        if incomplete then redis.call('HSET', state, 'incomplete', '1') end
        redis.call('HSET', state, 'frozen', '1')
        redis.call('HSETNX', state, 'snapshot_id', a1)
        changed(state)
      end
      replies[i] = {$GYM_OK, redis.call('HGET', state, 'snapshot_id'), tonumber(redis.call('HGET', state, 'version')),
        redis.call('HGET', state, 'incomplete') == '1' and 1 or 0}
    else
      replies[i] = {$GYM_WRONG_TYPE}
    end
  end
end
return replies
"""

GYM_SCRIPT: Final = library_script("gym", GYM_LUA, TOMBSTONE_PREFIX=TOMBSTONE_PREFIX)
"""The batch script of :mod:`sink.gym.store` (see the module docstring)."""
