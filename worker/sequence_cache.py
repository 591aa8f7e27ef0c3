"""Proven token sequences: a child's O(full) checks become one memcmp, its hash packs only its new ids.

A call's ``cumulative_hash`` covers its full sequence (contract §4.4), and
``begin_call`` / ``complete_call`` must prove that an explicit prefix and the
engine prompt's first ``prev_len`` ids are exact non-negative ints equal to
the authorized prefix (§5.3, §5.5). At turn 32 of a rollout the full sequence
is ~16x the delta, and proving exact ``int`` types element by element costs
~10 ns per id in any C-level builtin (``marshal``, ``map(type, ...)``), twice
the cost of hashing them.

A :class:`ProvenSequence` records, for a sequence of int objects the capture
has already proved exact ints in ``[0, 2**64)`` (by packing them with
:func:`sink.digest.encode_token_ids`): their u64 big-endian bytes and the
memory addresses of the objects themselves, while private lists keep every
one of those objects alive.

Soundness argument (why an address match is a proof):

* CPython's ``id(obj)`` is the object's address, and two objects alive at the
  same time never share an address. The proof holds strong references to all
  of its objects, so none of them is freed and no other object can occupy one
  of those addresses while the proof exists.
* So if a list's item pointers equal the proof's addresses byte for byte,
  every item *is* (identity, not ``==``) the corresponding proved object: an
  exact ``int`` (``int`` objects are immutable and cannot change class) with
  the recorded value. This rules out ``True``, ``1.0``, subclasses and
  negative values exactly as the reference type gate does, and implies list
  equality (``==`` on lists compares identical items as equal).
* Item pointers are read only from a list the caller has just created by
  slicing or copying and shares with no one, so no other thread can resize it
  while it is read.
* Anything that does not match (distinct but equal objects, another
  interpreter, a layout that fails the import-time self-test) is simply "not
  proved": the caller runs the reference checks and packs the full sequence,
  so the cache can only cost speed, never change an outcome. Cache keys (call
  ids) only choose which proof to try; a wrong guess is a miss.

:class:`SequenceHashCache` keeps, per rollout, the proofs of its most recent
calls (LRU over rollouts, thread-safe). A child's proof shares its parent's
pieces, so a branch costs only its own new ids.
"""

from __future__ import annotations

import ctypes
import sys
import sysconfig
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sink.digest import encode_token_ids, hash_packed_token_ids
from sink.packed import TrustedColumns

__all__ = ("EMPTY_SEQUENCE", "ProvenSequence", "SequenceHashCache", "item_addresses")

_COUNT_BYTES = 8  # encode_token_ids() starts with the u64 count
_ADDRESS_BYTES = ctypes.sizeof(ctypes.c_void_p)
# PyListObject: ob_refcnt, ob_type, ob_size (PyObject_VAR_HEAD), then ``PyObject **ob_item``.
_LIST_ITEMS_OFFSET = 3 * ctypes.sizeof(ctypes.c_ssize_t)


@contextmanager
def _list_items(values: list[Any]) -> Iterator[memoryview]:
    """A zero-copy byte view of the item-pointer array of *values* (CPython layout).

    *values* must be private to the caller: the view is only valid while the list is not resized.
    """
    nbytes = len(values) * _ADDRESS_BYTES
    items = ctypes.c_void_p.from_address(id(values) + _LIST_ITEMS_OFFSET).value if nbytes else None
    if items is None:
        yield memoryview(b"")
        return
    with memoryview((ctypes.c_char * nbytes).from_address(items)).cast("B") as view:
        yield view


def _read_list_items(values: list[Any]) -> bytes:
    """A copy of the item-pointer array of *values* (private to the caller)."""
    with _list_items(values) as view:
        return view.tobytes()


def _layout_verified() -> bool:
    """Whether this interpreter stores list items as :func:`_read_list_items` expects (checked against ``id``)."""
    if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return False
    # An empty list is exactly the five words of the expected layout (nothing is dereferenced before this).
    if [].__sizeof__() != _LIST_ITEMS_OFFSET + 2 * _ADDRESS_BYTES:
        return False
    probe: list[object] = [object(), 3**50, "probe", None]
    expected = b"".join(id(item).to_bytes(_ADDRESS_BYTES, sys.byteorder) for item in probe)
    return _read_list_items(probe) == expected


_ADDRESSES_READABLE = _layout_verified()


def item_addresses(values: list[int]) -> bytes | None:
    """The addresses of the items of *values*, packed, or ``None`` when this interpreter cannot tell.

    *values* must be a list the caller just created (a slice or copy) and shares with no one.
    """
    return _read_list_items(values) if _ADDRESSES_READABLE else None


@dataclass(frozen=True, slots=True, eq=False)
class ProvenSequence:
    """A sequence of int objects proved exact ints in ``[0, 2**64)``, as pieces (see the module docstring).

    Build one only with :meth:`extended` (from :data:`EMPTY_SEQUENCE`): it copies and packs the ids itself, so
    a proof never rests on a caller's claim. ``owners`` keep the proved objects alive.
    """

    length: int
    packed: tuple[bytes, ...]  # u64 big-endian ids, per piece
    addresses: tuple[bytes, ...]  # object addresses, per piece
    owners: tuple[list[int], ...]  # private lists holding the objects, per piece

    def extended(self, token_ids: list[int], *, proved: TrustedColumns | None = None) -> ProvenSequence | None:
        """This sequence followed by *token_ids*, or ``None`` when addresses are unreadable here.

        *proved*, if given, holds exactly this list as its ids (``proved.token_ids is token_ids``):
        :mod:`sink._packed.columns` proved them exact ints and packed them, so they are not packed again.

        :raises ValueError: an id is not an exact int in ``[0, 2**64)`` (the reference type gate).
        """
        owner = list(token_ids)  # private: nobody else can replace or drop these objects
        proved_ids = None if proved is None or proved.token_ids is not token_ids else proved.packed.ids_u64be
        packed = b"".join(proved_ids) if proved_ids else encode_token_ids(owner)[_COUNT_BYTES:]
        addresses = item_addresses(owner)
        if addresses is None:
            return None
        return ProvenSequence(
            self.length + len(owner),
            (*self.packed, packed),
            (*self.addresses, addresses),
            (*self.owners, owner),
        )

    def held_by(self, values: list[int]) -> ProvenSequence | None:
        """The same ids, proved for the objects of *values* instead (``None`` when addresses are unreadable).

        The caller must already have proved that every item of *values* is an exact ``int`` equal to the id at
        its position; *values* must be a list the caller just created and shares with no one.
        """
        addresses = item_addresses(values)
        if addresses is None or len(values) != self.length:
            return None
        return ProvenSequence(self.length, self.packed, (addresses,), (values,))

    def holds(self, values: list[int]) -> bool:
        """Whether every item of *values* is the very object proved at its position (``False``: not proved).

        *values* must be a list the caller just created (a slice or copy) and shares with no one.
        """
        if len(values) != self.length or not _ADDRESSES_READABLE:
            return False
        with _list_items(values) as found:  # compared in place: no O(full) copy
            offset = 0
            for piece in self.addresses:
                end = offset + len(piece)
                if not piece.startswith(found[offset:end]):  # equal lengths: memcmp equality
                    return False
                offset = end
        return True

    def cumulative_hash(self) -> str:
        """``hash_token_ids`` of the proved sequence, hashed piece by piece (nothing is concatenated)."""
        return hash_packed_token_ids(self.packed, self.length)


EMPTY_SEQUENCE = ProvenSequence(0, (), (), ())
"""The empty sequence (a text root's prefix): every proof starts here."""


class SequenceHashCache:
    """Per rollout, the :class:`ProvenSequence` of its most recent calls (LRU over rollouts, thread-safe).

    :param max_rollouts: rollouts remembered. Memory is about 24 bytes per remembered token (packed ids,
        addresses, a list slot), plus the int objects it keeps alive; a branch shares its parent's pieces.
    :param calls_per_rollout: recent calls remembered per rollout, so a retry or a sibling still hits.
    """

    def __init__(self, max_rollouts: int = 64, *, calls_per_rollout: int = 4) -> None:
        if max_rollouts < 1 or calls_per_rollout < 1:
            raise ValueError("max_rollouts and calls_per_rollout must be >= 1")
        self._max_rollouts = max_rollouts
        self._calls_per_rollout = calls_per_rollout
        self._lock = threading.Lock()
        self._rollouts: OrderedDict[str, OrderedDict[str, ProvenSequence]] = OrderedDict()

    def __len__(self) -> int:
        """Rollouts currently remembered."""
        with self._lock:
            return len(self._rollouts)

    def lookup(self, rollout_id: str, model_call_id: str | None) -> ProvenSequence | None:
        """The proof remembered for *model_call_id*'s full sequence, if any (a candidate, checked by the caller)."""
        if model_call_id is None:
            return EMPTY_SEQUENCE
        with self._lock:
            calls = self._rollouts.get(rollout_id)
            return None if calls is None else calls.get(model_call_id)

    def remember(self, rollout_id: str, model_call_id: str, proof: ProvenSequence) -> None:
        """Remember *proof* as *model_call_id*'s full sequence, evicting the least recently used entries."""
        evicted: list[object] = []
        with self._lock:
            calls = self._rollouts.get(rollout_id)
            if calls is None:
                calls = self._rollouts[rollout_id] = OrderedDict()
            self._rollouts.move_to_end(rollout_id)
            evicted.append(calls.get(model_call_id))
            calls[model_call_id] = proof
            calls.move_to_end(model_call_id)
            while len(calls) > self._calls_per_rollout:
                evicted.append(calls.popitem(last=False))
            while len(self._rollouts) > self._max_rollouts:
                evicted.append(self._rollouts.popitem(last=False))
        # Dropping a proof can free thousands of ids: let that happen here, outside the lock.
        evicted.clear()
