"""The server-side staging script: idempotent, conflict-checked, never half-written.

One ``EVALSHA`` stages a batch of records of one cluster slot (one server: any
records). For each record it either stores the blob and appends its
token-free entry to the rollout's ``calls`` stream, or, when the key already
holds a record, compares digests without writing. Every check that could make
a write fail (wrong key types) runs in a first pass, before any write, so an
error can never leave a record without its ``calls`` entry or the reverse.
"""

from __future__ import annotations

from typing import Final

from .. import record_schema

__all__ = (
    "CALLS_ENTRY_FIELDS",
    "STAGE_CONFLICT",
    "STAGE_SAME",
    "STAGE_SCRIPT",
    "STAGE_WRITTEN",
    "STAGE_WRONG_TYPE",
)

STAGE_WRITTEN: Final = 1
STAGE_SAME: Final = 2
STAGE_CONFLICT: Final = 0
STAGE_WRONG_TYPE: Final = -1

# Field names of one token-free entry in ns:{R}:calls, in ARGV order (from the record field table).
CALLS_ENTRY_FIELDS: Final = record_schema.CALLS_ENTRY_FIELDS

# KEYS: rec_1, calls_1, rec_2, calls_2, ...
# ARGV: head_bytes, rewrite_present ('1' or '0'), then per record: digest, blob, then the values of
# CALLS_ENTRY_FIELDS. The codec places the digest inside the first head_bytes
# bytes of every blob, so an existing record's digest is compared with
# GETRANGE instead of transferring the whole record.
_SCRIPT_TEMPLATE = """
local field_names = {@FIELDS@}
local nfields = #field_names
local head_len = tonumber(ARGV[1])
local rewrite_present = ARGV[2] == '1'
local per = 2 + nfields
local n = #KEYS / 2
local status = {}
-- pass 1, no writes: anything that could fail a write fails here
for i = 1, n do
  local rec_type = redis.call('TYPE', KEYS[2 * i - 1])['ok']
  local calls_type = redis.call('TYPE', KEYS[2 * i])['ok']
  if (rec_type ~= 'none' and rec_type ~= 'string') or (calls_type ~= 'none' and calls_type ~= 'stream') then
    status[i] = -1
  end
end
-- pass 2: write absent records with their calls entry; compare present ones
for i = 1, n do
  if status[i] == nil then
    local base = 2 + (i - 1) * per
    local digest = ARGV[base + 1]
    local head = redis.call('GETRANGE', KEYS[2 * i - 1], 0, head_len - 1)
    if head == '' then
      redis.call('SET', KEYS[2 * i - 1], ARGV[base + 2])
      local entry = {}
      for f = 1, nfields do
        entry[2 * f - 1] = field_names[f]
        entry[2 * f] = ARGV[base + 2 + f]
      end
      redis.call('XADD', KEYS[2 * i], '*', unpack(entry))
      status[i] = 1
    elseif string.find(head, digest, 1, true) then
      -- Same record. When replicas must confirm, write it again (same content by
      -- digest) so this connection's WAIT covers a write the replica must have,
      -- not just whatever this connection wrote last.
      if rewrite_present then
        redis.call('SET', KEYS[2 * i - 1], ARGV[base + 2])
      end
      status[i] = 2
    else
      status[i] = 0
    end
  end
end
return status
"""

STAGE_SCRIPT: Final = _SCRIPT_TEMPLATE.replace("@FIELDS@", ", ".join(f"'{name}'" for name in CALLS_ENTRY_FIELDS))
