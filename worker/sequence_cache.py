"""Proven token sequences: a child's O(full) checks become one ``marshal`` pass, its hash packs only its new ids.

A call's ``cumulative_hash`` covers its full sequence (contract §4.4), and
``begin_call`` / ``complete_call`` must prove that an explicit prefix and the
engine prompt's first ``prev_len`` ids are exact non-negative ints equal to
the authorized prefix (§5.3, §5.5). At turn 32 of a rollout the full sequence
is ~16x the delta; comparing it with ``==`` and then proving exact ``int``
types with ``map(type, ...)`` are two passes, and packing it for the hash is
a third.

A :class:`ProvenSequence` records, for ids the capture has already proved
exact ints in ``[0, 2**64)`` (by packing them with
:func:`sink.contract.digest.encode_token_ids`): their u64 big-endian bytes, which the
hash covers, and their *key*, the item bytes of ``marshal.dumps(ids, 2)``.
A list whose key equals the proof's key is proved in that one ``marshal``
pass plus a ``memcmp`` (the ids arrive as fresh objects or not).

Soundness argument (why a key match is a proof):

* ``marshal`` format version 2 writes no back-references, so it writes a
  list's items one after another, each from its own type and value only: an
  exact ``int`` as ``b"i"`` plus four bytes when it fits 32 signed bits, else
  ``b"l"`` plus its digits; ``True`` and ``False`` as ``b"T"`` and ``b"F"``,
  a ``float`` as ``b"g"`` plus eight bytes. It refuses an ``int`` subclass
  (``ValueError``).
* Each item starts with its type tag, and tag and value fix its length, so a
  byte string splits into items one way only: two lists with equal keys have
  items of equal types and values, position by position. A list with a
  proof's key is therefore a list of exact ints equal to the proved ids: it
  passes the reference type gate (``True``, ``1.0``, subclasses and negative
  values never do), equals the proved list, and packs to the proof's bytes.
* Keys are computed only from lists the caller has just created (a slice or
  copy) and shares with no one, so no other thread changes one while it is
  read, and a proof's key and packed bytes come from one ``marshal`` pass over
  one such list (a private copy, or the delta list
  :func:`sink.contract.packed.staging_delta_columns` built, whose pass it kept).
* Anything that does not match is simply "not proved": the caller runs the
  reference checks and packs the full sequence, so the cache can only cost
  speed, never change an outcome. Cache keys (call ids) only choose which
  proof to try; a wrong guess is a miss.

:class:`SequenceHashCache` keeps, per rollout, the proofs of its most recent
calls (LRU over rollouts, thread-safe). A child's proof shares its parent's
pieces, so a branch costs only its own new ids.

A call's proof is remembered with the ``chain_hash`` and ``cumulative_hash``
of the record built from it (:class:`RememberedCall`). A by-reference child
(contract §5.9) whose parent this capture built then needs only its parent's
staged record, not the whole chain: when the admission's ``staging_chain`` is
the chain the parent's prefix was checked from plus that record's key, the
record's chain hash is the admission's ``parent_chain_hash`` and its
cumulative hash is the remembered one, the remembered ids are the parent's
sequence (SHA-256 is collision resistant, and the cumulative hash covers
every id), so the prefix is known without fetching, hashing or unpacking
the ancestors (:meth:`worker.capture.RolloutTokenCapture.begin_call`).
"""

from __future__ import annotations

import marshal
import threading
from collections import OrderedDict
from dataclasses import dataclass

from sink.contract.digest import encode_token_ids, hash_packed_token_ids
from sink.contract.packed import PackedSnapshot, TrustedColumns, ids_from_marshal, unpack_list
from sink.contract.records import CaptureAdmission, StagedCallBaseSnapshot

__all__ = ("EMPTY_SEQUENCE", "ProvenSequence", "RememberedCall", "SequenceHashCache")

_COUNT_BYTES = 8  # encode_token_ids() starts with the u64 count
_MARSHAL_VERSION = 2  # the last version without back-references (see the module docstring)
_LIST_HEAD_BYTES = 5  # marshal's list header: b"[" then the int32 item count


def _marshalled(values: list[int]) -> bytes | None:
    """``marshal.dumps(values, 2)``, or ``None`` when marshal refuses an item (an int subclass, ...)."""
    try:
        return marshal.dumps(values, _MARSHAL_VERSION)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True, eq=False)
class ProvenSequence:
    """A sequence of ids proved exact ints in ``[0, 2**64)``, as pieces (see the module docstring).

    Build one only with :meth:`extended` (from :data:`EMPTY_SEQUENCE`): it copies, packs and keys the ids
    itself, so a proof never rests on a caller's claim.
    """

    length: int
    packed: tuple[bytes, ...]  # u64 big-endian ids, per piece
    keys: tuple[memoryview, ...]  # marshal item bytes of the ids, per piece (views of each piece's marshal blob)

    def extended(self, token_ids: list[int], *, proved: TrustedColumns | None = None) -> ProvenSequence:
        """This sequence followed by *token_ids*.

        *proved*, if given, holds exactly this list as its ids (``proved.token_ids is token_ids``):
        :func:`sink.contract.packed.staging_delta_columns` proved them exact ints and packed them from one
        ``marshal`` pass, whose blob it kept (``proved.ids_marshal``), so they are neither packed nor marshalled again.

        :raises ValueError: an id is not an exact int in ``[0, 2**64)`` (the reference type gate).
        """
        proved_ids = None if proved is None or proved.token_ids is not token_ids else proved.packed.ids_u64be
        if proved_ids and proved is not None and proved.ids_marshal is not None:
            # A list the columns built and own: its packed bytes and its key come from their one marshal pass.
            packed, blob = b"".join(proved_ids), proved.ids_marshal
        else:
            owner = list(token_ids)  # private: the key and the packed bytes come from this copy
            small = ids_from_marshal(owner, with_le=False)  # the usual ids (below 2**31): both from one pass
            # Otherwise the reference type gate packs them (or raises), then marshal writes their key.
            packed = bytes(small.be) if small is not None else encode_token_ids(owner)[_COUNT_BYTES:]
            marshalled = small.blob if small is not None else _marshalled(owner)
            if marshalled is None:  # not reached: the ids were just packed, and marshal writes every exact int
                raise ValueError("token ids must be exact ints")
            blob = marshalled
        key = memoryview(blob)[_LIST_HEAD_BYTES:]
        return ProvenSequence(self.length + len(packed) // 8, (*self.packed, packed), (*self.keys, key))

    def holds(self, values: list[int]) -> bool:
        """Whether *values* are exact ints equal, position by position, to the proved ids (``False``: not proved).

        One ``marshal`` pass over *values*, then its bytes compared in place with each piece's key.
        *values* must be a list the caller just created (a slice or copy) and shares with no one.
        """
        if len(values) != self.length:
            return False
        blob = _marshalled(values)
        if blob is None or len(blob) != _LIST_HEAD_BYTES + sum(map(len, self.keys)):
            return False
        offset = _LIST_HEAD_BYTES
        for key in self.keys:  # total lengths are equal, so each startswith is a memcmp of equal spans
            if not blob.startswith(key, offset):
                return False
            offset += len(key)
        return True

    def cumulative_hash(self) -> str:
        """``hash_token_ids`` of the proved sequence, hashed piece by piece (nothing is concatenated)."""
        return hash_packed_token_ids(self.packed, self.length)

    def ids(self) -> list[int]:
        """The proved ids, as a new list."""
        return unpack_list(self.packed, "Q", big_endian=True)


EMPTY_SEQUENCE = ProvenSequence(0, (), ())
"""The empty sequence (a text root's prefix): every proof starts here."""


@dataclass(frozen=True, slots=True, eq=False)
class RememberedCall:
    """A call's full sequence, proved, with the chain and cumulative hashes of the record built from it."""

    rollout_id: str
    model_call_id: str
    proof: ProvenSequence
    chain_hash: str
    cumulative_hash: str
    staging_chain: tuple[str, ...] | None = None
    """The staging chain the call's prefix was resolved and checked from (``()``: a text root; ``None``: not
    checked from a chain, so no child takes the short path)."""

    def is_record(self, snapshot: object) -> bool:
        """Whether the fetched *snapshot* is the record this call was built into: its rollout, call id, length,
        chain hash and cumulative hash are the remembered ones (``False``: fetch and check the whole chain, §5.9)."""
        if not isinstance(snapshot, PackedSnapshot | StagedCallBaseSnapshot):
            return False
        return (
            snapshot.rollout_id == self.rollout_id
            and snapshot.model_call_id == self.model_call_id
            and snapshot.cum_len == self.proof.length
            and snapshot.chain_hash == self.chain_hash
            and snapshot.cumulative_hash == self.cumulative_hash
        )


class SequenceHashCache:
    """Per rollout, the :class:`ProvenSequence` of its most recent calls (LRU over rollouts, thread-safe).

    :param max_rollouts: rollouts remembered. Memory is about 13 bytes per remembered token (8 packed, 5 of
        key for an id below 2**31); a branch shares its parent's pieces.
    :param calls_per_rollout: recent calls remembered per rollout, so a retry or a sibling still hits.
    """

    def __init__(self, max_rollouts: int = 64, *, calls_per_rollout: int = 4) -> None:
        if max_rollouts < 1 or calls_per_rollout < 1:
            raise ValueError("max_rollouts and calls_per_rollout must be >= 1")
        self._max_rollouts = max_rollouts
        self._calls_per_rollout = calls_per_rollout
        self._lock = threading.Lock()
        self._rollouts: OrderedDict[str, OrderedDict[str, RememberedCall]] = OrderedDict()

    def __len__(self) -> int:
        """Rollouts currently remembered."""
        with self._lock:
            return len(self._rollouts)

    def lookup(self, rollout_id: str, model_call_id: str | None) -> ProvenSequence | None:
        """The proof remembered for *model_call_id*'s full sequence, if any (a candidate, checked by the caller)."""
        if model_call_id is None:
            return EMPTY_SEQUENCE
        remembered = self._remembered(rollout_id, model_call_id)
        return None if remembered is None else remembered.proof

    def parent_of(self, admission: CaptureAdmission) -> RememberedCall | None:
        """What is remembered of *admission*'s parent when it is the parent the admission names: its length is
        ``prev_len``, its record's chain hash the ``parent_chain_hash``, and the ``staging_chain`` is the chain the
        parent's prefix was checked from plus one key (a candidate: that last key's record is still checked,
        :meth:`RememberedCall.is_record`)."""
        if admission.parent_call_id is None:
            return None
        remembered = self._remembered(admission.rollout_id, admission.parent_call_id)
        if remembered is None or remembered.proof.length != admission.prev_len:
            return None
        if remembered.chain_hash != admission.parent_chain_hash or remembered.staging_chain is None:
            return None
        chain = admission.staging_chain
        if len(chain) != len(remembered.staging_chain) + 1 or tuple(chain[:-1]) != remembered.staging_chain:
            return None  # not the chain the parent was checked with: the whole chain is fetched and checked
        return remembered

    def _remembered(self, rollout_id: str, model_call_id: str) -> RememberedCall | None:
        with self._lock:
            calls = self._rollouts.get(rollout_id)
            return None if calls is None else calls.get(model_call_id)

    def proved_copy(self, admission: CaptureAdmission, values: object) -> tuple[list[int], ProvenSequence] | None:
        """A private copy of *values* and the proof of the admission's parent that holds it, or ``None``.

        ``None`` means "not proved" (the caller runs the reference checks on *values*).
        """
        if type(values) is not list:
            return None
        proof = self.lookup(admission.rollout_id, admission.parent_call_id)
        if proof is None or proof.length != len(values):
            return None
        snapshot: list[int] = values[:]  # private: nobody can change it while it is read
        return (snapshot, proof) if proof.holds(snapshot) else None

    def remember(
        self,
        rollout_id: str,
        model_call_id: str,
        proof: ProvenSequence,
        *,
        chain_hash: str,
        cumulative_hash: str,
        staging_chain: tuple[str, ...] | None = None,
    ) -> None:
        """Remember *proof* as *model_call_id*'s full sequence, with the *chain_hash* and *cumulative_hash* of the
        record built from it and the *staging_chain* its prefix was checked from (``None``: none), evicting the
        least recently used entries."""
        remembered = RememberedCall(rollout_id, model_call_id, proof, chain_hash, cumulative_hash, staging_chain)
        evicted: list[object] = []
        with self._lock:
            calls = self._rollouts.get(rollout_id)
            if calls is None:
                calls = self._rollouts[rollout_id] = OrderedDict()
            self._rollouts.move_to_end(rollout_id)
            evicted.append(calls.get(model_call_id))
            calls[model_call_id] = remembered
            calls.move_to_end(model_call_id)
            while len(calls) > self._calls_per_rollout:
                evicted.append(calls.popitem(last=False))
            while len(self._rollouts) > self._max_rollouts:
                evicted.append(self._rollouts.popitem(last=False))
        # Dropping a proof can free megabytes of pieces: let that happen here, outside the lock.
        evicted.clear()
