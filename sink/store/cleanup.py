"""Deleting staged records once a rollout has been consumed.

Each rollout's records and its ``calls`` entries go in one single-slot script,
so ``clear`` never leaves a ``calls`` entry pointing at a deleted record.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..keys import calls_stream, record_key, rollout_of_staging_key
from .connection import ServerScript, Topology, map_redis_errors

__all__ = ("CLEAR_SCRIPT", "clear_staged")

# KEYS: calls stream, then the record keys; ARGV: the staging keys, same order.
# Deletes the records and the calls entries naming them; drops an emptied stream.
CLEAR_SCRIPT = """
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
return removed
"""
_CLEAR = ServerScript(CLEAR_SCRIPT)


async def clear_staged(topology: Topology, namespace: str, staging_keys: Sequence[str]) -> int:
    """Delete the records named by *staging_keys* and their ``calls`` entries; return how many existed.

    :raises TypeError: *staging_keys* is a single ``str``.
    :raises ValueError: a key was not minted by this sink (``R/...``).
    :raises StagingConnectionError: the server could not be reached.
    """
    if isinstance(staging_keys, str):
        raise TypeError("clear() takes a sequence of staging keys, not a single str")
    by_rollout: dict[str, list[str]] = {}
    for key in dict.fromkeys(staging_keys):
        by_rollout.setdefault(rollout_of_staging_key(key), []).append(key)
    removed = 0
    with map_redis_errors("clear staged records"):
        for rollout_id, keys in by_rollout.items():
            script_keys = [calls_stream(namespace, rollout_id), *(record_key(namespace, k) for k in keys)]
            client = topology.node_for_key(script_keys[0])
            removed += int(await _CLEAR.run(client, script_keys, keys))
    return removed
