"""Lineage fingerprints, version 3 (contract §6.4)."""

from __future__ import annotations

import copy
import hashlib
import re
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sink.canonical import canonical_json
from sink.contract.fingerprint import (
    FINGERPRINT_VERSION,
    FingerprintInputError,
    assistant_fingerprint,
    conversation_digest,
)

HEX64 = re.compile(r"[0-9a-f]{64}")


def framed(domain: bytes, *fields: tuple[int, str]) -> str:
    """Independent reference framing: domain, then tag || u64be(len) || utf8 per field."""
    payload = b"".join(bytes((tag,)) + struct.pack(">Q", len(t.encode())) + t.encode() for tag, t in fields)
    return hashlib.sha256(domain + payload).hexdigest()


def af(*fields: tuple[int, str]) -> str:
    return framed(b"nemo-gym-lineage", *fields)


def cd(*fields: tuple[int, str]) -> str:
    return framed(b"nemo-gym-lineage-context", *fields)


def assistant(content: Any = None, **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content, **extra}


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


# --- framing, pinned against an independent encoder ---------------------------


def test_version_is_three() -> None:
    assert FINGERPRINT_VERSION == 3


def test_assistant_text_framing() -> None:
    assert assistant_fingerprint([assistant("hi")]) == af((0x00, "text"), (0x01, "hi"))


def test_function_call_framing_with_namespace() -> None:
    item = {
        "type": "function_call",
        "call_id": "c1",
        "id": "fc_9",
        "namespace": "web",
        "name": "search",
        "arguments": '{"q": "é", "n": 2}',
    }
    expected = af((0x02, "c1"), (0x03, "web__search"), (0x04, '{"n":2,"q":"é"}'))
    assert assistant_fingerprint([item]) == expected


def test_function_call_falls_back_to_id_and_has_no_prefix_without_namespace() -> None:
    item = {"type": "function_call", "id": "fc_9", "name": "search", "arguments": None}
    assert assistant_fingerprint([item]) == af((0x02, "fc_9"), (0x03, "search"), (0x04, ""))


def test_tool_use_and_chat_tool_calls_framing_and_order() -> None:
    item = assistant(
        [
            {"type": "text", "text": "let me look"},
            {"type": "tool_use", "id": "tu1", "name": "grep", "input": {"b": 1, "a": [1, 2]}},
        ],
        tool_calls=[{"id": "tc1", "type": "function", "function": {"name": "ls", "arguments": '{"path":"/"}'}}],
    )
    expected = af(
        (0x00, "text"),
        (0x01, "let me look"),
        (0x02, "tu1"),
        (0x03, "grep"),
        (0x04, '{"a":[1,2],"b":1}'),
        (0x02, "tc1"),
        (0x03, "ls"),
        (0x04, '{"path":"/"}'),
    )
    assert assistant_fingerprint([item]) == expected


def test_conversation_digest_framing() -> None:
    items = [
        {"role": "system", "content": "today is monday"},
        user([{"type": "input_text", "text": "hi"}]),
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": {"ok": True}},
        {"role": "tool", "tool_call_id": "t1", "content": "done"},
        {"type": "reasoning", "summary": []},
    ]
    expected = cd(
        (0x00, "system"),
        (0x00, "user"),
        (0x01, "text"),
        (0x02, "hi"),
        (0x00, "function_call"),
        (0x03, "c1"),
        (0x04, "f"),
        (0x05, "{}"),
        (0x00, "function_call_output"),
        (0x06, "c1"),
        (0x07, '{"ok":true}'),
        (0x00, "tool"),
        (0x01, "text"),
        (0x02, "done"),
        (0x06, "t1"),
        (0x07, "done"),
        (0x00, "reasoning"),
    )
    assert conversation_digest(items) == expected


def test_tool_result_block_is_a_result_not_a_part() -> None:
    items = [user([{"type": "tool_result", "tool_use_id": "tu1", "content": [{"type": "text", "text": "x"}]}])]
    expected = cd((0x00, "user"), (0x06, "tu1"), (0x07, '[{"text":"x","type":"text"}]'))
    assert conversation_digest(items) == expected


def test_empty_conversation_digest_is_the_bare_domain() -> None:
    assert conversation_digest([]) == hashlib.sha256(b"nemo-gym-lineage-context").hexdigest()


# --- model-authored selection -------------------------------------------------


@pytest.mark.parametrize(
    "items",
    [
        [],
        [user("hi")],
        [{"role": "system", "content": "s"}, {"role": "developer", "content": "d"}],
        [{"type": "reasoning", "role": "assistant", "content": "thinking"}],
        [{"type": "function_call_output", "call_id": "c", "output": "x"}],
    ],
)
def test_no_model_authored_item_gives_empty_fingerprint(items: list[dict[str, Any]]) -> None:
    assert assistant_fingerprint(items) == ""


def test_assistant_with_no_content_still_fingerprints() -> None:
    fingerprint = assistant_fingerprint([assistant(None)])
    assert fingerprint == hashlib.sha256(b"nemo-gym-lineage").hexdigest()
    assert assistant_fingerprint([assistant("")]) == fingerprint
    assert assistant_fingerprint([{"role": "assistant"}]) == fingerprint


def test_non_model_items_do_not_change_the_assistant_fingerprint() -> None:
    base = [assistant("a"), {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]
    noisy = [
        {"role": "system", "content": "s"},
        user("u"),
        base[0],
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r"}]},
        base[1],
        {"type": "function_call_output", "call_id": "c", "output": "o"},
    ]
    assert assistant_fingerprint(noisy) == assistant_fingerprint(base)


# --- content parts ------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        "hello",
        ["hello"],
        ["", "hello"],
        [{"type": "text", "text": "hello"}],
        [{"type": "output_text", "text": "hello", "annotations": []}],
        [{"type": "input_text", "text": "hello"}],
        [{"type": "", "text": "hello"}],
        [{"text": "hello"}],
        [{"type": "text", "text": ""}, "hello"],
        [{"type": "tool_result", "tool_use_id": "x", "content": "ignored as a part"}, "hello"],
    ],
)
def test_text_like_content_shapes_are_equivalent(content: Any) -> None:
    assert assistant_fingerprint([assistant(content)]) == af((0x00, "text"), (0x01, "hello"))


def test_other_typed_block_is_type_and_canonical_json() -> None:
    block = {"type": "image_url", "image_url": {"url": "u", "detail": "auto"}}
    expected = af((0x00, "image_url"), (0x01, '{"image_url":{"detail":"auto","url":"u"},"type":"image_url"}'))
    assert assistant_fingerprint([assistant([block])]) == expected
    reordered = {"image_url": {"detail": "auto", "url": "u"}, "type": "image_url"}
    assert assistant_fingerprint([assistant([reordered])]) == expected
    # A text-typed block whose text is not a string is serialized as a typed block.
    assert assistant_fingerprint([assistant([{"type": "text", "text": None}])]) == af(
        (0x00, "text"), (0x01, '{"text":null,"type":"text"}')
    )


def test_canonical_json_is_sorted_compact_utf8() -> None:
    assert canonical_json({"b": [1, {"d": 1, "c": "é"}], "a": None}) == '{"a":null,"b":[1,{"c":"é","d":1}]}'


# --- argument canonicalization --------------------------------------------------


def chat_call(arguments: Any) -> dict[str, Any]:
    return assistant(None, tool_calls=[{"id": "t", "function": {"name": "f", "arguments": arguments}}])


def test_json_string_arguments_are_canonicalized() -> None:
    first = assistant_fingerprint([chat_call('{"a":1, "b":2}')])
    assert first == assistant_fingerprint([chat_call('{"b":2,"a":1}')])
    assert first == assistant_fingerprint([chat_call({"b": 2, "a": 1})])  # non-string -> canonical JSON
    assert first != assistant_fingerprint([chat_call('{"a":1,"b":3}')])


def test_unparsable_arguments_are_stripped_and_none_is_empty() -> None:
    assert assistant_fingerprint([chat_call("  not json ")]) == assistant_fingerprint([chat_call("not json")])
    assert assistant_fingerprint([chat_call(None)]) == assistant_fingerprint([chat_call("")])
    assert assistant_fingerprint([chat_call(None)]) == af((0x02, "t"), (0x03, "f"), (0x04, ""))


def test_tool_call_entry_without_function_reads_empty() -> None:
    item = assistant(None, tool_calls=[{"id": "t"}])
    assert assistant_fingerprint([item]) == af((0x02, "t"), (0x03, ""), (0x04, ""))


def test_namespace_is_part_of_the_name() -> None:
    plain = {"type": "function_call", "call_id": "c", "name": "search", "arguments": "{}"}
    spaced = {**plain, "namespace": "web"}
    prefixed = {**plain, "name": "web__search"}
    assert assistant_fingerprint([spaced]) != assistant_fingerprint([plain])
    assert assistant_fingerprint([spaced]) == assistant_fingerprint([prefixed])


# --- tool results (conversation digest only) ----------------------------------


def test_tool_result_payloads_are_canonical_json() -> None:
    def output(payload: Any) -> list[dict[str, Any]]:
        return [{"type": "function_call_output", "call_id": "c", "output": payload}]

    assert conversation_digest(output({"b": 1, "a": 2})) == conversation_digest(output({"a": 2, "b": 1}))
    assert conversation_digest(output("x")) != conversation_digest(output("y"))
    assert conversation_digest(output(None)) == cd((0x00, "function_call_output"), (0x06, "c"), (0x07, "null"))


def test_tool_result_blocks_use_tool_use_id_then_id() -> None:
    by_tool_use_id = [user([{"type": "tool_result", "tool_use_id": "a", "id": "b", "content": "x"}])]
    by_id = [user([{"type": "tool_result", "id": "a", "content": "x"}])]
    assert conversation_digest(by_tool_use_id) == conversation_digest(by_id)


# --- instruction items and order -----------------------------------------------


def test_instruction_content_is_ignored_but_its_role_counts() -> None:
    base = [{"role": "system", "content": "date: monday"}, user("hi")]
    changed = [{"role": "system", "content": [{"type": "text", "text": "date: tuesday"}]}, user("hi")]
    as_developer = [{"role": "developer", "content": "date: monday"}, user("hi")]
    assert conversation_digest(base) == conversation_digest(changed)
    assert conversation_digest(base) != conversation_digest(as_developer)
    assert conversation_digest(base) != conversation_digest(base[1:])


def test_instruction_content_is_not_shape_checked() -> None:
    # Instruction items contribute nothing beyond their role, so their content is never parsed.
    weird = [{"role": "system", "content": 42}, user("hi")]
    assert conversation_digest(weird) == conversation_digest([{"role": "system"}, user("hi")])


def test_user_content_changes_the_digest() -> None:
    assert conversation_digest([user("a")]) != conversation_digest([user("b")])


def test_order_sensitivity() -> None:
    a, b = assistant("a"), assistant("b")
    assert assistant_fingerprint([a, b]) != assistant_fingerprint([b, a])
    assert conversation_digest([user("a"), user("b")]) != conversation_digest([user("b"), user("a")])


def test_role_falls_back_to_type_then_empty() -> None:
    assert conversation_digest([{"type": "message", "content": "x"}]) == cd(
        (0x00, "message"), (0x01, "text"), (0x02, "x")
    )
    assert conversation_digest([{"content": "x"}]) == cd((0x00, ""), (0x01, "text"), (0x02, "x"))


# --- errors ---------------------------------------------------------------------


@pytest.mark.parametrize("item", [None, "assistant", ["role", "assistant"], 3])
@pytest.mark.parametrize("function", [assistant_fingerprint, conversation_digest])
def test_non_dict_items_raise(item: Any, function: Any) -> None:
    with pytest.raises(ValueError, match="must be dicts"):
        function([assistant("ok"), item])


@pytest.mark.parametrize(
    "item",
    [
        assistant(5),
        assistant({"type": "text", "text": "x"}),
        assistant([7]),
        assistant([None]),
        assistant([{"content": "no type, no text"}]),
        assistant([{"type": "", "text": 3}]),
        assistant([{"type": 5, "text": "x"}]),
        assistant([{"type": "image", "data": {1, 2}}]),
        assistant(None, tool_calls="not a list"),
        assistant(None, tool_calls=["not a dict"]),
        assistant(None, tool_calls=[{"id": "t", "function": "f"}]),
        assistant(None, tool_calls=[{"id": 5, "function": {"name": "f"}}]),
        {"type": "function_call", "call_id": "c", "name": ["f"], "arguments": "{}"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": {"x": object()}},
    ],
)
def test_malformed_model_items_raise_value_error(item: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as excinfo:
        assistant_fingerprint([item])
    assert isinstance(excinfo.value, FingerprintInputError)
    with pytest.raises(ValueError):
        conversation_digest([item])


def test_non_string_role_raises_in_conversation_digest() -> None:
    with pytest.raises(ValueError, match="role"):
        conversation_digest([{"role": 1, "content": "x"}])


def test_malformed_tool_result_id_raises() -> None:
    with pytest.raises(ValueError, match="call_id"):
        conversation_digest([{"type": "function_call_output", "call_id": 7, "output": "x"}])


# --- stability (property tests) ---------------------------------------------------

_text = st.text(max_size=12)
_block = st.one_of(
    _text,
    st.builds(lambda t: {"type": "output_text", "text": t}, _text),
    st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, _text),
)
_content = st.one_of(st.none(), _text, st.lists(_block, max_size=3))
_model_item = st.one_of(
    st.builds(assistant, _content),
    st.builds(
        lambda i, n, a: {"type": "function_call", "call_id": i, "name": n, "arguments": a},
        _text,
        _text,
        st.dictionaries(_text, st.integers(), max_size=3).map(canonical_json),
    ),
)
_other_item = st.one_of(
    st.builds(user, _content),
    st.builds(lambda c: {"role": "system", "content": c}, _content),
    st.builds(lambda i, o: {"type": "function_call_output", "call_id": i, "output": o}, _text, _text),
    st.just({"type": "reasoning", "summary": []}),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(_model_item, _other_item), max_size=6))
def test_fingerprints_are_stable_hex_and_pure(items: list[dict[str, Any]]) -> None:
    snapshot = copy.deepcopy(items)
    first = assistant_fingerprint(items)
    digest = conversation_digest(items)
    assert items == snapshot  # inputs are not mutated
    assert assistant_fingerprint(copy.deepcopy(items)) == first
    assert conversation_digest(copy.deepcopy(items)) == digest
    assert HEX64.fullmatch(digest)
    model_items = [item for item in items if item.get("role") == "assistant" or item.get("type") == "function_call"]
    if model_items:
        assert HEX64.fullmatch(first)
        assert first == assistant_fingerprint(model_items)
    else:
        assert first == ""


@settings(max_examples=40, deadline=None)
@given(st.lists(_model_item, min_size=1, max_size=4), _content, _content)
def test_instruction_content_never_matters(items: list[dict[str, Any]], first: Any, second: Any) -> None:
    one = [{"role": "developer", "content": first}, *items]
    two = [{"role": "developer", "content": second}, *items]
    assert conversation_digest(one) == conversation_digest(two)


def test_runaway_nesting_is_a_value_error() -> None:
    nested: list[Any] = []
    for _ in range(5000):
        nested = [nested]
    with pytest.raises(FingerprintInputError, match="JSON-serializable"):
        assistant_fingerprint([assistant([{"type": "blob", "value": nested}])])
    with pytest.raises(FingerprintInputError, match="nest too deeply"):
        assistant_fingerprint([chat_call("[" * 100_000 + "]" * 100_000)])
