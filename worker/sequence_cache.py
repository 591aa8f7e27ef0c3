"""Cumulative hashes without re-packing the whole conversation on every call.

A call's ``cumulative_hash`` covers its full sequence (contract §4.4): the
parent's full sequence plus this call's delta. At turn 32 of a rollout that is
~16x more tokens than the delta, and packing Python ints dominates the
worker's CPU. :class:`SequenceHashCache` keeps, per rollout, the last built
call's full sequence and its packed form; a child whose prefix equals that
sequence (checked by value, one C-level list comparison) packs only its own
new tokens. A miss (a retry of an older call, an evicted rollout) falls back
to packing everything: the hash is the same either way.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from sink.digest import encode_token_ids, hash_packed_token_ids

__all__ = ("SequenceHashCache",)

_COUNT_BYTES = 8  # encode_token_ids() starts with the u64 count


class SequenceHashCache:
    """Per rollout, the most recent call's full sequence and its packed ids (LRU over rollouts).

    :param max_rollouts: rollouts remembered; memory is about 16 bytes per token of each remembered sequence.
    """

    def __init__(self, max_rollouts: int = 64) -> None:
        if max_rollouts < 1:
            raise ValueError("max_rollouts must be >= 1")
        self._max_rollouts = max_rollouts
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[str, list[int], bytes]] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def cumulative_hash(
        self,
        rollout_id: str,
        model_call_id: str,
        parent_call_id: str | None,
        prefix: Sequence[int],
        rest: Sequence[int],
    ) -> str:
        """``hash_token_ids(prefix + rest)``, re-using the parent's packed sequence when it is *prefix*.

        Remembers ``prefix + rest`` as *model_call_id*'s sequence for its children.

        :raises ValueError: an id is not an exact int in ``[0, 2**64)``.
        """
        with self._lock:
            entry = self._entries.get(rollout_id)
        parent_packed: bytes | None = None
        if entry is not None and parent_call_id is not None and entry[0] == parent_call_id and entry[1] == prefix:
            parent_packed = entry[2]
        if parent_packed is None:
            parent_packed = encode_token_ids(prefix)[_COUNT_BYTES:]
        packed = parent_packed + encode_token_ids(rest)[_COUNT_BYTES:]
        sequence = [*prefix, *rest]
        with self._lock:
            self._entries[rollout_id] = (model_call_id, sequence, packed)
            self._entries.move_to_end(rollout_id)
            while len(self._entries) > self._max_rollouts:
                self._entries.popitem(last=False)
        return hash_packed_token_ids([packed], len(sequence))
