"""Parent resolution for ``/v1/completions`` in exact-prefix mode: which earlier call a prompt extends (pure, no I/O).

A completions prompt is one string (or one list of token ids), so the gate's item fingerprints see every call as a
root. In exact mode the proxy remembers, per rollout, each captured call's *exact text*: its prompt followed by the
text it served (for a token-id prompt, its prompt ids followed by its generated ids), and how that text splits into
alternating prompt (``u``) and generated (``a``) segments. A later prompt that starts with a remembered exact text
(the longest one wins: the deepest call) continues that call: its conversation items are the remembered segments,
then the new suffix as one user item. The gate then resolves the parent from those items exactly as for chat (the
parent's row was committed with the same items), so an index entry that is stale or wrong finds no parent (a loud
``unresolved_parent``), never a wrong one.

A call that stopped on a stop string is remembered twice: with its served text (the stop string dropped, as the
agent saw it) and with the stop string after it (an ``s`` segment: text the call's ids hold but did not serve). A
ReAct agent appends the stop string itself ("Observation:"); its next prompt then matches the longer entry, so the
stop string it typed is not sent again after the ids that already hold it (the engine sees it once). For the gate,
an ``s`` piece belongs to the next prompt item, so the items are what they would be without it.

Token ids are spelled ``"1,2,3,"`` (each id followed by a comma), so "starts with" on the spelling is "starts with"
on the ids; an item's content is then ``"token_ids:1,2,3"``, as :func:`worker.proxy.routes.request_items` spells a
root's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

__all__ = ("ExactText", "Segment", "index_entry", "match_parent", "prompt_text", "spell_ids")

Kind = Literal["t", "i"]
"""``t``: a text prompt; ``i``: a token-id prompt."""
Segment = tuple[Literal["u", "a", "s"], int]
"""One piece of an exact text: its role (``u`` prompt, ``a`` generated and served, ``s`` a stop string the call's
ids hold but its served text dropped) and its length in characters."""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def spell_ids(ids: Sequence[int]) -> str:
    """*ids* as the index spells them (``"1,2,3,"``)."""
    return "".join(f"{token}," for token in ids)


@dataclass(frozen=True)
class ExactText:
    """A completions prompt as the index sees it, and what it continues (if anything)."""

    kind: Kind
    text: str
    """The prompt (a string, or the spelling of its ids)."""
    parent_segments: tuple[Segment, ...] = ()
    """The matched parent's segments (empty: a root)."""

    @property
    def parent_length(self) -> int:
        return sum(length for _, length in self.parent_segments)

    @property
    def suffix(self) -> str:
        """What the prompt adds after the parent's exact text (the whole prompt for a root)."""
        return self.text[self.parent_length :]

    def segments(self) -> list[Segment]:
        """The prompt's own segments: the parent's, then the suffix as a prompt segment (if not empty)."""
        out = list(self.parent_segments)
        if self.suffix or not out:
            out.append(("u", len(self.suffix)))
        return out

    def _content(self, piece: str) -> str:
        return piece if self.kind == "t" else "token_ids:" + piece.rstrip(",")

    def items(self) -> list[dict[str, Any]]:
        """The conversation items the gate resolves the parent from (a root: the one user item of the prompt); a
        stop-string piece is the head of the prompt item after it (as the agent typed it)."""
        out: list[dict[str, Any]] = []
        start = 0
        carried = ""
        for role, length in self.segments():
            piece = self.text[start : start + length]
            start += length
            if role == "s":
                carried += piece
            elif role == "u":
                out.append({"role": "user", "content": self._content(carried + piece)})
                carried = ""
            else:
                out.append({"role": "assistant", "content": self._content(piece)})
        if carried:  # the prompt ends with the stop string: it is the last prompt item
            out.append({"role": "user", "content": self._content(carried)})
        return out


def prompt_text(prompt: Any) -> ExactText | None:
    """*prompt* (a completions ``prompt``) as an :class:`ExactText` root, or ``None`` for another shape."""
    if isinstance(prompt, str):
        return ExactText("t", prompt)
    if isinstance(prompt, list) and prompt and all(type(token) is int for token in prompt):
        return ExactText("i", spell_ids(prompt))
    return None


def index_entry(call: ExactText, served: str, stop: str = "") -> tuple[str, bytes]:
    """The index field and value remembering *call* once it served *served* (text, or spelled generated ids), followed
    by *stop*: a stop string its ids hold but *served* dropped (see the module docstring)."""
    segments: list[Segment] = [*call.segments(), ("a", len(served))]
    if stop:
        segments.append(("s", len(stop)))
    full = call.text + served + stop
    return f"{call.kind}{len(full)}:{_digest(full)}", orjson.dumps(segments)


def _segments(raw: Any, length: int) -> tuple[Segment, ...] | None:
    try:
        segments = tuple((str(role), int(size)) for role, size in orjson.loads(raw))
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return None
    if any(role not in ("u", "a", "s") or size < 0 for role, size in segments) or sum(s for _, s in segments) != length:
        return None
    return segments  # type: ignore[return-value]  # roles checked above


def match_parent(call: ExactText, index: Mapping[bytes, bytes]) -> ExactText:
    """*call* with the deepest remembered exact text its prompt starts with (unchanged when none does).

    Entries of the other kind, longer than the prompt, or malformed are ignored.
    """
    best: tuple[Segment, ...] = ()
    for raw_field, raw_value in index.items():
        head, _, digest = raw_field.decode(errors="replace").partition(":")
        if head[:1] != call.kind or not head[1:].isdigit():
            continue
        length = int(head[1:])
        if length > len(call.text) or length <= sum(s for _, s in best) or _digest(call.text[:length]) != digest:
            continue
        segments = _segments(raw_value, length)
        if segments is not None:
            best = segments
    return ExactText(call.kind, call.text, best)
