"""The splice rule of exact-prefix (token-in/token-out) mode: pure functions, no I/O.

A continuation call's history must never be re-templated: the engine would render earlier turns from text, and
text does not give back the ids that were generated (a template that drops earlier reasoning, a stop string whose
completing token the text drops, ``ignore_eos`` outputs with end-of-turn ids inside, re-tokenization). So the
proxy renders the request with the engine's own template, cuts the rendering after the end-of-turn that closes the
last assistant message, and puts the parent's exact staged sequence (its prompt ids then its generated ids) in
place of everything up to that point. What follows (new tool or user turns, the generation prompt) is kept as
rendered.

Where the boundary is. Count the end-of-turn ids in a rendering of the messages up to and including the last
assistant message, without the generation prompt (``history_eot_count``): the boundary is that many end-of-turns
into the full rendering. Counting in a rendering, never in the parent's exact sequence, matters: with
``ignore_eos`` the parent's generated ids hold extra end-of-turn ids. Counting in a rendering of the history
itself (rather than one per message) also holds for templates that inject a default system message, merge
consecutive tool turns, or drop a turn, and for message text that spells an end-of-turn token: both renderings
see the same thing. (:func:`history_eot_count_by_messages` is the one-per-message count for templates known to
render one turn per message, when a second render is not wanted.)

The closing end-of-turn. When the parent's generated ids do not end with an end-of-turn id (it stopped on a stop
string or at ``max_tokens``), the rendered end-of-turn at the boundary is kept after the parent's sequence, so the
next turn starts in a closed turn as the template would have it; it is a prompt id of the new call (mask 0),
never a generated one.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from sink.contract.digest_encoding import U64, encode_token_ids
from sink.contract.packed import ids_from_marshal
from worker.errors import SpliceError

__all__ = (
    "ScannedIds",
    "context_digest",
    "count_end_of_turn",
    "end_of_turn_positions",
    "history_eot_count_by_messages",
    "last_assistant_index",
    "splice_exact_prompt",
)


def count_end_of_turn(token_ids: Sequence[int], eot_ids: Collection[int]) -> int:
    """How many ids of *token_ids* are end-of-turn ids."""
    ids = token_ids if isinstance(token_ids, list) else list(token_ids)
    return sum(map(ids.count, set(eot_ids)))  # list.count: one C pass per end-of-turn id, no Python per token


def end_of_turn_positions(token_ids: Sequence[int], eot_ids: Collection[int]) -> list[int]:
    """The positions of the end-of-turn ids in *token_ids*, ascending (found with ``list.index``: a C scan)."""
    ids = token_ids if isinstance(token_ids, list) else list(token_ids)
    positions: list[int] = []
    for eot in set(eot_ids):
        start = 0
        try:
            while True:
                start = ids.index(eot, start) + 1
                positions.append(start - 1)
        except ValueError:  # no more of this id
            continue
    positions.sort()
    return positions


_CONTEXT_DOMAIN = b"staging-sink-rendered-context-v1"
_U32_LE = struct.Struct("<I")
_SMALL_ID_LIMIT = 1 << 31  # the ids the one-pass proof packs (ids_from_marshal); an id from here is not among them


def _positions_in_u32le(ids_u32le: bytes, eot_ids: Collection[int]) -> list[int]:
    """The positions of the end-of-turn ids in ids packed as u32 little-endian: their four bytes at a multiple of 4."""
    positions: list[int] = []
    for eot in {eot for eot in eot_ids if 0 <= eot < _SMALL_ID_LIMIT}:
        needle = _U32_LE.pack(eot)
        found = ids_u32le.find(needle)
        while found >= 0:
            if found % 4:  # the bytes straddle two ids: not this id
                found = ids_u32le.find(needle, found + 1)
            else:
                positions.append(found // 4)
                found = ids_u32le.find(needle, found + 4)
    positions.sort()
    return positions


@dataclass(frozen=True, slots=True, eq=False)
class ScannedIds:
    """A rendering's ids, proved exact ints in ``[0, 2**64)``, with their end-of-turn positions and their u64
    big-endian bytes: everything the splice and the context digests read, from one pass over the ids.

    Build one with :meth:`of`.
    """

    ids: list[int]
    eot_positions: list[int]
    """The positions of the end-of-turn ids in :attr:`ids`, ascending."""
    ids_u64be: bytes
    """:attr:`ids` as u64 big-endian, as :func:`sink.contract.digest.encode_token_ids` packs them (without the count)."""

    @classmethod
    def of(cls, token_ids: Sequence[int], eot_ids: Collection[int]) -> ScannedIds:
        """Scan *token_ids* (a list of small ids: one ``marshal`` pass and a byte search; others: the reference checks).

        A list is kept as :attr:`ids`, not copied (a render answer's, parsed for this call): do not change it.

        :raises ValueError: an id is not an exact int in ``[0, 2**64)``.
        """
        if isinstance(token_ids, list) and (packed := ids_from_marshal(token_ids)) is not None:
            # (a list subclass is never proved here: marshal_list takes exact lists)
            return cls(token_ids, _positions_in_u32le(packed.le, eot_ids), bytes(packed.be))
        ids = list(token_ids)
        return cls(ids, end_of_turn_positions(ids, eot_ids), encode_token_ids(ids)[U64.size :])

    def context_digest(self, turns: int) -> str:
        """:func:`context_digest` of these ids through their *turns*-th end-of-turn id (the empty prefix for 0).

        :raises SpliceError: fewer than *turns* end-of-turn ids.
        """
        end = 0
        if turns > 0:
            if len(self.eot_positions) < turns:
                raise SpliceError(f"the rendering holds {len(self.eot_positions)} end-of-turn ids, fewer than {turns}")
            end = self.eot_positions[turns - 1] + 1
        digest = hashlib.sha256(_CONTEXT_DOMAIN + U64.pack(end))
        digest.update(memoryview(self.ids_u64be)[: U64.size * end])
        return digest.hexdigest()


def context_digest(token_ids: Sequence[int], eot_ids: Collection[int], turns: int) -> str:
    """The digest of *token_ids* through their *turns*-th end-of-turn id (the empty prefix for 0 turns): what a
    rendered context is compared by (a continuation's history against its parent's own rendering).

    It is ``sha256(b"staging-sink-rendered-context-v1" || encode_token_ids(ids[:end]))``.

    :raises SpliceError: fewer than *turns* end-of-turn ids.
    :raises ValueError: an id is not an exact int in ``[0, 2**64)``.
    """
    return ScannedIds.of(token_ids, eot_ids).context_digest(turns)


def last_assistant_index(messages: Sequence[Any]) -> int | None:
    """The index of the last message whose role is ``assistant``, or ``None``."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if isinstance(message, dict) and message.get("role") == "assistant":
            return index
    return None


def history_eot_count_by_messages(messages: Sequence[Any], *, injected_turns: int = 0) -> int:
    """End-of-turns up to the last assistant message for a one-turn-per-message template.

    :param injected_turns: turns the template adds before the messages (a default system message).
    :raises SpliceError: no assistant message.
    """
    index = last_assistant_index(messages)
    if index is None:
        raise SpliceError("no assistant message: the call is not a continuation")
    return index + 1 + injected_turns


def splice_exact_prompt(
    rendered_ids: Sequence[int],
    *,
    history_eot_count: int,
    eot_ids: Collection[int],
    parent_ids: Sequence[int],
    eot_positions: Sequence[int] | None = None,
) -> list[int]:
    """The exact prompt of a continuation: the parent's sequence, then the rendered suffix after the boundary.

    :param rendered_ids: the engine's rendering of the whole request (with the generation prompt).
    :param history_eot_count: end-of-turn ids in the rendering of the messages through the last assistant one.
    :param eot_ids: the template's end-of-turn id(s).
    :param parent_ids: the parent's exact staged sequence (prompt ids then generated ids).
    :param eot_positions: the positions of the end-of-turn ids in *rendered_ids* when already known
        (:class:`ScannedIds`); found here otherwise.
    :raises SpliceError: a count below 1, fewer end-of-turns in the rendering than the count, an empty parent, or
        nothing rendered after the boundary.
    """
    if history_eot_count < 1:
        raise SpliceError(f"history_eot_count must be at least 1, got {history_eot_count}")
    if not parent_ids:
        raise SpliceError("the parent's exact sequence is empty")
    if not eot_ids:
        raise SpliceError("no end-of-turn id given")
    positions = end_of_turn_positions(rendered_ids, eot_ids) if eot_positions is None else eot_positions
    if len(positions) < history_eot_count:
        raise SpliceError(
            f"the rendering holds {len(positions)} end-of-turn ids, fewer than the {history_eot_count} of the history"
        )
    boundary = positions[history_eot_count - 1]
    suffix = list(rendered_ids[boundary + 1 :])
    if not suffix:
        raise SpliceError("nothing is rendered after the last assistant turn (no generation prompt)")
    closing = [] if parent_ids[-1] in eot_ids else [rendered_ids[boundary]]
    return [*parent_ids, *closing, *suffix]
