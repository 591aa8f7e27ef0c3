"""The NeMo Gym transport's one Lua script, ``GYM_SCRIPT`` (its status codes are
:class:`~sink.store.scripts.status.GymStatus`; re-exported by :mod:`sink.store.scripts`, whose import registers
every script in the one library).

The script runs a batch of operations, each on the keys of one rollout, all of one cluster slot (the
group commit in :mod:`sink.store.commit` queues it like the staging script). Per rollout ``R``, in a key
family of its own (:func:`sink.keys.gym_keys`; no key of the RL path starts with ``ns:gym:``):

===========================  ======  ===========================================================================
key                          type    holds
===========================  ======  ===========================================================================
``ns:gym:{R}``               hash    the sink's state: ``version`` (its changes), ``incomplete``, ``touched_ms``
``ns:gym:{R}:entries``       hash    the open rollout's ``model_call_id`` -> encoded entry (:mod:`sink.gym.codec`)
``ns:gym:{R}:digests``       hash    ``model_call_id`` -> the entry's digest (identity of its payload)
``ns:gym:{R}:intents``       set     the call ids ``begin_call`` announced
``ns:gym:{R}:frozen``        hash    the snapshot: ``snapshot_id``, ``version``, ``incomplete``, ``seen`` (the
                                     state's ``version`` it took in), ``touched_ms``; exists once frozen
``ns:gym:{R}:snapshot``      hash    the frozen rollout's entries (the first freeze renames ``entries`` to it)
``ns:gym:{R}:tombstone``     string  a dropped snapshot's identity, kept ``retention_ms``
===========================  ======  ===========================================================================

The first four belong to the sink, the last three to the source, and the ACL roles follow that split
(:mod:`sink.ops.access.policy`): the server checks every command a script runs against the calling user, so a
role may run the same commands directly, and the layout is what keeps the invariants. A frozen rollout's
entries and identity live in keys the sink cannot write, so no raw write of the sink changes what a snapshot
identity covers; what it may still write (its state, a detached ``entries`` hash) only ever makes the next
freeze report a new ``version`` (or nothing at all).

KEYS: per operation those seven keys, in that order. ARGV: ``retention_ms``, ``rewrite`` (``'1'`` when
replicas must confirm: an identical put writes its digest again so this connection's ``WAIT`` covers it),
then per operation four values ``op, a1, a2, a3``:

* ``put, call_id, digest, blob`` -> ``{GYM_OK}`` written, ``{GYM_SAME}``, ``{GYM_CONFLICT}`` (the rollout
  is marked incomplete, nothing else written), ``{GYM_FROZEN}`` or ``{GYM_RETIRED}``;
* ``mark, call_id`` -> ``{GYM_OK, state version}`` or ``{GYM_RETIRED}``;
* ``begin, call_id`` -> ``{GYM_OK}``, ``{GYM_FROZEN}`` or ``{GYM_RETIRED}``;
* ``freeze, new_snapshot_id`` -> ``{GYM_OK, snapshot_id, version, incomplete}`` or ``{GYM_RETIRED}``; the
  first freeze decides ``incomplete`` (the state's flag, or an intent without its entry), moves the entries
  to ``snapshot`` and writes ``frozen`` at ``version`` 1; a later one that finds the state changed since
  (a ``mark``) takes the flag in and increments ``version``, else changes nothing. The entries are read with
  a plain ``HVALS`` of ``snapshot`` right after the script in the same round trip (a frozen rollout's entries
  no longer change, and copying megabytes through a Lua table costs more than the read itself);
* ``drop, snapshot_id, version`` -> ``{GYM_OK}`` (dropped now, or dropped before with this identity) or
  ``{GYM_DROP_REFUSED}`` (nothing deleted): refused unless frozen at exactly that identity with no change of
  the state since that freeze.

Any operation meeting a key of the wrong type gets ``{GYM_WRONG_TYPE}`` from a first pass that writes
nothing. The state's ``version`` counts the sink's changes (a new entry, a conflict, a mark); an identical
put and a ``begin`` leave it alone. Every command that may be refused to the calling role comes before the
operation's first write, so a role that calls another role's operation changes nothing.
"""

from __future__ import annotations

from typing import Final

from sink.store.scripts.status import library_script

__all__ = (
    "GYM_KEYS_PER_OP",
    "GYM_LUA",
    "GYM_SCRIPT",
    "TOMBSTONE_PREFIX",
)

GYM_KEYS_PER_OP: Final = 7

TOMBSTONE_PREFIX: Final = "gym-drop "
"""The tombstone value a drop leaves: this prefix, then ``<snapshot_id>:<version>`` (a repeated drop matches it)."""

GYM_LUA: Final = """
local retention_ms = tonumber(ARGV[1])
local rewrite = ARGV[2] == '1'
local n = #KEYS / 7
local replies = {}
local expected = {'hash', 'hash', 'hash', 'set', 'hash', 'hash', 'string'}
-- pass 1, no writes: a key of the wrong type fails its operation here
for i = 1, n do
  for k = 1, 7 do
    local t = redis.call('TYPE', KEYS[7 * (i - 1) + k])['ok']
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
    local b = 7 * (i - 1)
    local state, entries, digests, intents = KEYS[b + 1], KEYS[b + 2], KEYS[b + 3], KEYS[b + 4]
    local frozen, snapshot, tomb = KEYS[b + 5], KEYS[b + 6], KEYS[b + 7]
    local a = 2 + 4 * (i - 1)
    local op, a1, a2, a3 = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4]
    if op == 'drop' then
      local tombstone = redis.call('GET', tomb)
      local identity = '$TOMBSTONE_PREFIX' .. a1 .. ':' .. a2
      if tombstone then
        if tombstone == identity then replies[i] = {$GYM_OK} else replies[i] = {$GYM_DROP_REFUSED} end
      elseif redis.call('HGET', frozen, 'snapshot_id') == a1 and redis.call('HGET', frozen, 'version') == a2
          and (redis.call('HGET', state, 'version') or '0') == redis.call('HGET', frozen, 'seen') then
        redis.call('DEL', state)
        redis.call('DEL', entries)
        redis.call('DEL', digests)
        redis.call('DEL', intents)
        redis.call('DEL', frozen)
        redis.call('DEL', snapshot)
        redis.call('SET', tomb, identity, 'PX', retention_ms)
        replies[i] = {$GYM_OK}
      else
        replies[i] = {$GYM_DROP_REFUSED}
      end
    elseif redis.call('EXISTS', tomb) == 1 then
      replies[i] = {$GYM_RETIRED}
    elseif op == 'put' then
      if redis.call('EXISTS', frozen) == 1 then
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
      if redis.call('EXISTS', frozen) == 1 then
        replies[i] = {$GYM_FROZEN}
      else
        redis.call('SADD', intents, a1)
        redis.call('HSETNX', state, 'version', 0)
        redis.call('HSET', state, 'touched_ms', now_ms)
        replies[i] = {$GYM_OK}
      end
    elseif op == 'freeze' then
      local seen = redis.call('HGET', state, 'version') or '0'
      local marked = redis.call('HGET', state, 'incomplete') == '1'
      if redis.call('EXISTS', frozen) == 0 then
        local incomplete = marked
        if not incomplete then
          for _, call_id in ipairs(redis.call('SMEMBERS', intents)) do
            if redis.call('HEXISTS', digests, call_id) == 0 then
              incomplete = true
              break
            end
          end
        end
        if redis.call('EXISTS', entries) == 1 then
          redis.call('RENAME', entries, snapshot)
        else
          redis.call('DEL', snapshot)
        end
        redis.call('HSET', frozen, 'snapshot_id', a1, 'version', '1', 'seen', seen,
          'incomplete', incomplete and '1' or '0', 'touched_ms', now_ms)
      elseif redis.call('HGET', frozen, 'seen') ~= seen then
        if marked then redis.call('HSET', frozen, 'incomplete', '1') end
        redis.call('HSET', frozen, 'seen', seen, 'touched_ms', now_ms)
        redis.call('HINCRBY', frozen, 'version', 1)
      end
      replies[i] = {$GYM_OK, redis.call('HGET', frozen, 'snapshot_id'),
        tonumber(redis.call('HGET', frozen, 'version')), redis.call('HGET', frozen, 'incomplete') == '1' and 1 or 0}
    else
      replies[i] = {$GYM_WRONG_TYPE}
    end
  end
end
return replies
"""

GYM_SCRIPT: Final = library_script("gym", GYM_LUA, TOMBSTONE_PREFIX=TOMBSTONE_PREFIX)
"""The batch script of :mod:`sink.gym.store` (see the module docstring)."""
