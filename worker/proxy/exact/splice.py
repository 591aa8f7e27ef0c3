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

from collections.abc import Collection, Sequence
from typing import Any

from worker.errors import SpliceError

__all__ = (
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
) -> list[int]:
    """The exact prompt of a continuation: the parent's sequence, then the rendered suffix after the boundary.

    :param rendered_ids: the engine's rendering of the whole request (with the generation prompt).
    :param history_eot_count: end-of-turn ids in the rendering of the messages through the last assistant one.
    :param eot_ids: the template's end-of-turn id(s).
    :param parent_ids: the parent's exact staged sequence (prompt ids then generated ids).
    :raises SpliceError: a count below 1, fewer end-of-turns in the rendering than the count, an empty parent, or
        nothing rendered after the boundary.
    """
    if history_eot_count < 1:
        raise SpliceError(f"history_eot_count must be at least 1, got {history_eot_count}")
    if not parent_ids:
        raise SpliceError("the parent's exact sequence is empty")
    if not eot_ids:
        raise SpliceError("no end-of-turn id given")
    positions = end_of_turn_positions(rendered_ids, eot_ids)
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
