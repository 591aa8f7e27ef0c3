"""Lineage fingerprints of conversation items, version 3 (contract §6.4).

Two token-free hashes join text-level conversations to capture-ledger rows:

* :func:`assistant_fingerprint` hashes only what the model wrote (assistant
  messages and ``function_call`` items). The gate stamps it on every row as
  ``output_fingerprint`` (the call's output) and ``continuation_fingerprint``
  (request + output); the ledger matches a new request's fingerprint against
  them to find the parent call, and the receipt assembler uses them as a
  content witness for the terminal call.
* :func:`conversation_digest` hashes the request context around those items
  (user turns, tool results, ...), skipping the volatile content of system and
  developer instructions.

Both hashes are ``SHA-256(DOMAIN || fields)`` where every field is streamed as
``tag byte || u64be(len(utf8)) || utf8``. Item boundaries are not framed, as in
the reference layout. Shape errors raise ``ValueError`` so callers can treat a
malformed conversation as "no fingerprint" with one ``except`` clause
(:class:`FingerprintInputError`, a ``ValueError``).

Interpretations where the contract is terse (documented, deliberate):

* a content block whose ``type`` key is absent counts as type ``""`` for the
  text-like check, so ``{"text": "hi"}`` is a text part; an absent ``type``
  without a string ``text`` is "a dict without type" and raises;
* ids, names and roles must be strings when present (``None`` or absent reads
  as ``""``); any other value raises ``ValueError``;
* a ``role == "tool"`` message contributes its content both as parts and as a
  tool result payload, since every non-instruction item contributes its parts.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final

from sink.canonical import canonical_json as _canonical_json
from sink.errors import FingerprintInputError

__all__ = (
    "ASSISTANT_FINGERPRINT_DOMAIN",
    "CONVERSATION_DIGEST_DOMAIN",
    "FINGERPRINT_VERSION",
    "FingerprintInputError",
    "assistant_fingerprint",
    "conversation_digest",
    "is_instruction_item",
    "is_model_authored",
)

FINGERPRINT_VERSION: Final = 3

ASSISTANT_FINGERPRINT_DOMAIN: Final = b"nemo-gym-lineage"
CONVERSATION_DIGEST_DOMAIN: Final = b"nemo-gym-lineage-context"

_U64 = struct.Struct(">Q")
_TEXT_LIKE_TYPES = frozenset({"", "text", "input_text", "output_text"})
_TOOL_BLOCK_TYPES = frozenset({"tool_use", "tool_result"})
_INSTRUCTION_ROLES = frozenset({"system", "developer"})

# (tag for the part type, tag for the part payload), per hash.
_AF_PART_TAGS = (0x00, 0x01)
_AF_CALL_TAGS = (0x02, 0x03, 0x04)
_CD_ROLE_TAG = 0x00
_CD_PART_TAGS = (0x01, 0x02)
_CD_CALL_TAGS = (0x03, 0x04, 0x05)
_CD_RESULT_TAGS = (0x06, 0x07)


def _fingerprint_json(value: Any) -> str:
    """*value* as canonical JSON (NaN allowed, as the fingerprint contract serializes it).

    :raises FingerprintInputError: *value* is not JSON-serializable (a ``ValueError``).
    """
    try:
        return _canonical_json(value, allow_nan=True)
    except (TypeError, RecursionError) as exc:
        # Unserializable values, mixed-type dict keys and runaway nesting are shape errors.
        raise FingerprintInputError(f"fingerprint input is not JSON-serializable: {exc!r}") from None


class _FieldHasher:
    """SHA-256 over a domain followed by tagged, length-prefixed UTF-8 fields."""

    __slots__ = ("_hash",)

    def __init__(self, domain: bytes) -> None:
        self._hash = hashlib.sha256(domain)

    def field(self, tag: int, text: str) -> None:
        raw = text.encode("utf-8")
        self._hash.update(bytes((tag,)) + _U64.pack(len(raw)) + raw)

    def item_body(self, item: Mapping[str, Any], part_tags: tuple[int, int], call_tags: tuple[int, int, int]) -> None:
        """Stream *item*'s content parts, then its tool calls, with the given tags."""
        type_tag, payload_tag = part_tags
        for part_type, payload in _content_parts(item.get("content")):
            self.field(type_tag, part_type)
            self.field(payload_tag, payload)
        id_tag, name_tag, args_tag = call_tags
        for call_id, name, args in _tool_calls(item):
            self.field(id_tag, call_id)
            self.field(name_tag, name)
            self.field(args_tag, args)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _optional_str(item: Mapping[str, Any], key: str) -> str:
    value = item.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise FingerprintInputError(f"fingerprint field {key!r} must be a string, got {type(value).__name__}")
    return value


def _first_str(item: Mapping[str, Any], *keys: str) -> str:
    # "call_id or id": the first non-empty one wins.
    for key in keys:
        value = _optional_str(item, key)
        if value:
            return value
    return ""


def _check_item(item: object) -> Mapping[str, Any]:
    if not isinstance(item, Mapping):
        raise FingerprintInputError(f"conversation items must be dicts, got {type(item).__name__}")
    return item


def is_model_authored(item: Mapping[str, Any]) -> bool:
    """Return whether *item* was written by the model (assistant message or ``function_call``).

    Reasoning items are never model-authored for lineage purposes.
    """
    item_type = item.get("type")
    if item_type == "reasoning":
        return False
    return item.get("role") == "assistant" or item_type == "function_call"


def is_instruction_item(item: Mapping[str, Any]) -> bool:
    """Return whether *item* is a system or developer instruction."""
    return item.get("role") in _INSTRUCTION_ROLES


def _content_parts(content: object) -> Iterator[tuple[str, str]]:
    """Yield the ``(type, payload)`` parts of one item's ``content``."""
    if content is None:
        return
    if isinstance(content, str):
        if content:
            yield ("text", content)
        return
    if not isinstance(content, list):
        raise FingerprintInputError(f"item content must be None, a string or a list, got {type(content).__name__}")
    for block in content:
        if isinstance(block, str):
            if block:
                yield ("text", block)
            continue
        if not isinstance(block, Mapping):
            raise FingerprintInputError(f"content blocks must be strings or dicts, got {type(block).__name__}")
        block_type = block.get("type", "")
        if not isinstance(block_type, str):
            raise FingerprintInputError(f"content block type must be a string, got {type(block_type).__name__}")
        if block_type in _TOOL_BLOCK_TYPES:
            continue  # reported as a tool call / tool result instead
        text = block.get("text")
        if isinstance(text, str) and block_type in _TEXT_LIKE_TYPES:
            if text:
                yield ("text", text)
            continue
        if not block_type:
            raise FingerprintInputError("a content block without a type must carry a string 'text'")
        yield (block_type, _fingerprint_json(block))


def _canonical_args(arguments: object) -> str:
    if arguments is None:
        return ""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments.strip()
        except RecursionError:
            raise FingerprintInputError("tool-call arguments nest too deeply to canonicalize") from None
        return _fingerprint_json(parsed)
    return _fingerprint_json(arguments)


def _canonical_payload(payload: object) -> str:
    return payload if isinstance(payload, str) else _fingerprint_json(payload)


def _content_blocks(item: Mapping[str, Any], block_type: str) -> Iterator[Mapping[str, Any]]:
    content = item.get("content")
    if isinstance(content, list):
        for block in content:
            if isinstance(block, Mapping) and block.get("type") == block_type:
                yield block


def _tool_calls(item: Mapping[str, Any]) -> Iterator[tuple[str, str, str]]:
    """Yield ``(id, name, args)`` in contract order: the item itself, tool_use blocks, chat tool_calls."""
    if item.get("type") == "function_call":
        name = _optional_str(item, "name")
        namespace = _optional_str(item, "namespace")
        if namespace:
            name = f"{namespace}__{name}"
        yield (_first_str(item, "call_id", "id"), name, _canonical_args(item.get("arguments")))
    for block in _content_blocks(item, "tool_use"):
        yield (_optional_str(block, "id"), _optional_str(block, "name"), _canonical_args(block.get("input")))
    chat_calls = item.get("tool_calls")
    if chat_calls is None:
        return
    if not isinstance(chat_calls, list):
        raise FingerprintInputError(f"tool_calls must be a list, got {type(chat_calls).__name__}")
    for call in chat_calls:
        if not isinstance(call, Mapping):
            raise FingerprintInputError(f"tool_calls entries must be dicts, got {type(call).__name__}")
        function = call.get("function")
        if function is None:
            function = {}
        if not isinstance(function, Mapping):
            raise FingerprintInputError(f"tool_calls function must be a dict, got {type(function).__name__}")
        yield (_optional_str(call, "id"), _optional_str(function, "name"), _canonical_args(function.get("arguments")))


def _tool_results(item: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """Yield ``(id, payload)``: a function_call_output item, a tool message, tool_result blocks."""
    if item.get("type") == "function_call_output":
        yield (_first_str(item, "call_id", "id"), _canonical_payload(item.get("output")))
    if item.get("role") == "tool":
        yield (_optional_str(item, "tool_call_id"), _canonical_payload(item.get("content")))
    for block in _content_blocks(item, "tool_result"):
        yield (_first_str(block, "tool_use_id", "id"), _canonical_payload(block.get("content")))


def assistant_fingerprint(items: Iterable[object]) -> str:
    """Fingerprint the model-authored items of a conversation (domain ``nemo-gym-lineage``).

    :returns: 64 lowercase hex characters, or ``""`` when no item is model-authored.
    :raises FingerprintInputError: an item is not a dict, or has an unsupported shape (a ``ValueError``).
    """
    hasher = _FieldHasher(ASSISTANT_FINGERPRINT_DOMAIN)
    found = False
    for raw_item in items:
        item = _check_item(raw_item)
        if not is_model_authored(item):
            continue
        found = True
        hasher.item_body(item, _AF_PART_TAGS, _AF_CALL_TAGS)
    return hasher.hexdigest() if found else ""


def conversation_digest(items: Iterable[object]) -> str:
    """Digest a conversation's context (domain ``nemo-gym-lineage-context``).

    Every item contributes its role (else its type, else ``""``); instruction
    items contribute nothing more, other items their parts, tool calls and
    tool results.

    :returns: 64 lowercase hex characters (also for an empty conversation).
    :raises FingerprintInputError: an item is not a dict, or has an unsupported shape (a ``ValueError``).
    """
    hasher = _FieldHasher(CONVERSATION_DIGEST_DOMAIN)
    result_id_tag, result_payload_tag = _CD_RESULT_TAGS
    for raw_item in items:
        item = _check_item(raw_item)
        hasher.field(_CD_ROLE_TAG, _optional_str(item, "role") or _optional_str(item, "type"))
        if is_instruction_item(item):
            continue  # instruction content is volatile (dates, budgets)
        hasher.item_body(item, _CD_PART_TAGS, _CD_CALL_TAGS)
        for result_id, payload in _tool_results(item):
            hasher.field(result_id_tag, result_id)
            hasher.field(result_payload_tag, payload)
    return hasher.hexdigest()
