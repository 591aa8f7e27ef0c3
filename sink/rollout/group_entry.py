"""The group entry of a receipts stream (contract §7.6): one entry for a whole GRPO group.

An :class:`~sink.rollout.assembler.Assembler` records each group member's receipts-entry fields in the group's
record (``ns:{grp:<id>}:members``) instead of publishing them, and publishes one entry for the group once its member
set is frozen (complete, or sealed at ``group_timeout_s``). The entry names the group and its members; a reader
reads the members' fields from the record. A member arriving after its group was frozen is published alone, as a
receipt entry marked late (``group_late``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

from sink.keys import validate_rollout_id
from sink.rollout.done_event import parse_group_fields

__all__ = ("GroupEntry", "group_entry_fields", "parse_group_entry")

GroupState = Literal["complete", "sealed", "late"]


class GroupEntry(NamedTuple):
    """How a grouped rollout was published: in the entry of its group (``complete``: every member announced;
    ``sealed``: frozen at ``group_timeout_s`` with the members that had arrived) or alone, ``late``.
    ``members``: every member the entry names; ``mismatch``: members announced different sizes (the largest is
    ``group_size``)."""

    group_id: str
    group_size: int
    state: GroupState
    members: tuple[str, ...]
    mismatch: bool = False


def group_entry_fields(
    group_id: str, group_size: int, state: Literal["complete", "sealed"], members: Sequence[str], *, mismatch: bool
) -> dict[str, str]:
    """The fields of a group's receipts entry (members sorted)."""
    return {
        "group_id": group_id,
        "group_size": str(group_size),
        "group_state": state,
        "group_members": ",".join(sorted(members)),
        "group_mismatch": "1" if mismatch else "0",
    }


def parse_group_entry(fields: Mapping[str, str]) -> GroupEntry | None:
    """The group a receipts entry delivers: a group entry's, or a late member's (``group_late``); ``None`` for a
    receipt entry of a rollout without a group.

    :raises ValueError: malformed group fields.
    """
    tag = parse_group_fields(fields)
    if "group_members" not in fields:
        if tag is None or fields.get("group_late") != "1":
            return None
        return GroupEntry(tag.group_id, tag.group_size, "late", (fields.get("rollout_id", ""),))
    text = fields.get("group_state")
    state: GroupState = "complete" if text == "complete" else "sealed"
    if tag is None or text not in ("complete", "sealed"):
        raise ValueError(f"malformed group entry: group {tag!r}, state {text!r}")
    members = tuple(validate_rollout_id(member) for member in fields["group_members"].split(","))
    if len(set(members)) != len(members):
        raise ValueError(f"malformed group entry: a member named twice in {members!r}")
    return GroupEntry(tag.group_id, tag.group_size, state, members, fields.get("group_mismatch") == "1")
