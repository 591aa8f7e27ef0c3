"""The splice rule of exact-prefix mode (:mod:`worker.proxy.exact.splice`): properties over generated conversations on
model templates (ChatML, one that drops earlier reasoning, one that injects a default system message, one that
merges consecutive tool turns), parents that stopped on end-of-turn, on a stop string, at max_tokens or with
``ignore_eos`` (end-of-turn ids inside the output), and message text that spells the end-of-turn token."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sink.contract.digest import encode_token_ids
from worker.errors import SpliceError
from worker.proxy.exact.splice import (
    ScannedIds,
    context_digest,
    count_end_of_turn,
    end_of_turn_positions,
    history_eot_count_by_messages,
    last_assistant_index,
    splice_exact_prompt,
)

START, EOT, NL = 1, 2, 3
THINK_END = 4
Message = dict[str, Any]
Template = Callable[[Sequence[Message], bool], list[int]]


def text_ids(text: str) -> list[int]:
    """Character ids; ``</t>`` is the reasoning end and ``<e>`` the end-of-turn, as a tokenizer parses specials."""
    ids: list[int] = []
    index = 0
    while index < len(text):
        if text.startswith("</t>", index):
            ids.append(THINK_END)
            index += 4
        elif text.startswith("<e>", index):
            ids.append(EOT)
            index += 3
        else:
            ids.append(16 + ord(text[index]))
            index += 1
    return ids


def turn(role: str, content: str) -> list[int]:
    return [START, *text_ids(role), NL, *text_ids(content), EOT, NL]


def chatml(messages: Sequence[Message], generation_prompt: bool) -> list[int]:
    ids = [token for m in messages for token in turn(m["role"], m["content"])]
    return ids + ([START, *text_ids("assistant"), NL] if generation_prompt else [])


def drops_reasoning(messages: Sequence[Message], generation_prompt: bool) -> list[int]:
    ids: list[int] = []
    for m in messages:
        content = m["content"].split("</t>")[-1] if m["role"] == "assistant" else m["content"]
        ids += turn(m["role"], content)
    return ids + ([START, *text_ids("assistant"), NL, *text_ids("<t>"), NL] if generation_prompt else [])


def default_system(messages: Sequence[Message], generation_prompt: bool) -> list[int]:
    injected = [] if messages and messages[0]["role"] == "system" else turn("system", "default")
    return injected + chatml(messages, generation_prompt)


def merges_tools(messages: Sequence[Message], generation_prompt: bool) -> list[int]:
    ids: list[int] = []
    index = 0
    while index < len(messages):
        if messages[index]["role"] == "tool":
            results = []
            while index < len(messages) and messages[index]["role"] == "tool":
                results.append(messages[index]["content"])
                index += 1
            ids += turn("user", "|".join(results))
            continue
        ids += turn(messages[index]["role"], messages[index]["content"])
        index += 1
    return ids + ([START, *text_ids("assistant"), NL] if generation_prompt else [])


TEMPLATES: dict[str, Template] = {
    "chatml": chatml,
    "drops_reasoning": drops_reasoning,
    "default_system": default_system,
    "merges_tools": merges_tools,
}

texts = st.lists(st.sampled_from(["a", "b", " ", "</t>", "<e>"]), max_size=6).map("".join)
generated = st.lists(st.sampled_from([EOT, THINK_END, NL, *range(16 + 97, 16 + 100)]), min_size=1, max_size=12)
observations = st.lists(st.tuples(st.sampled_from(["tool", "user"]), texts), min_size=1, max_size=3)


@st.composite
def conversations(draw: st.DrawFn) -> tuple[list[Message], list[Message]]:
    """(history through the last assistant message, the new messages after it)."""
    history: list[Message] = []
    if draw(st.booleans()):
        history.append({"role": "system", "content": draw(texts)})
    history.append({"role": "user", "content": draw(texts)})
    for _ in range(draw(st.integers(0, 2))):
        history.append({"role": "assistant", "content": draw(texts)})
        history += [{"role": role, "content": text} for role, text in draw(observations)]
    history.append({"role": "assistant", "content": draw(texts)})
    new = [{"role": role, "content": text} for role, text in draw(observations)]
    return history, new


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(TEMPLATES)), conversations(), generated)
def test_splice_keeps_the_parent_exact_and_the_rendered_suffix(
    name: str, conversation: tuple[list[Message], list[Message]], parent_generated: list[int]
) -> None:
    template = TEMPLATES[name]
    history, new = conversation
    parent_ids = template(history[:-1], True) + parent_generated  # what the parent call saw and generated
    rendered = template(history + new, True)
    count = count_end_of_turn(template(history, False), {EOT})
    spliced = splice_exact_prompt(rendered, history_eot_count=count, eot_ids={EOT}, parent_ids=parent_ids)
    closing = [] if parent_generated[-1] == EOT else [EOT]
    # The oracle: after the closed assistant turn, the template renders "\n" then the new turns alone.
    suffix = [NL, *template(new, True)] if name != "default_system" else [NL, *chatml(new, True)]
    assert spliced == parent_ids + closing + suffix
    assert spliced[: len(parent_ids)] == parent_ids


@settings(max_examples=100, deadline=None)
@given(conversations(), generated)
def test_one_turn_per_message_count_agrees_with_the_history_rendering(
    conversation: tuple[list[Message], list[Message]], parent_generated: list[int]
) -> None:
    history, new = conversation
    if any(EOT in text_ids(m["content"]) for m in history):
        return  # text that spells the end-of-turn needs the rendered count
    by_render = count_end_of_turn(chatml(history, False), {EOT})
    assert history_eot_count_by_messages(history + new) == by_render
    injected = 0 if history[0]["role"] == "system" else 1
    assert history_eot_count_by_messages(history + new, injected_turns=injected) == count_end_of_turn(
        default_system(history, False), {EOT}
    )


def reasoning_after_last_user(messages: Sequence[Message], generation_prompt: bool) -> list[int]:
    """Qwen3's rule: an assistant turn keeps its reasoning only after the last user message."""
    last_user = max((index for index, m in enumerate(messages) if m["role"] == "user"), default=-1)
    ids: list[int] = []
    for index, m in enumerate(messages):
        kept = m["role"] != "assistant" or index > last_user
        ids += turn(m["role"], m["content"] if kept else m["content"].split("</t>")[-1])
    return ids + ([START, *text_ids("assistant"), NL] if generation_prompt else [])


def _continuation(template: Template, reply: str) -> tuple[list[Message], list[Message]]:
    history = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "r</t>a"},
        {"role": "tool", "content": "x"},
        {"role": "assistant", "content": reply},
    ]
    return history, [{"role": "user", "content": "n"}]


def _parent_context(template: Template, history: list[Message]) -> tuple[list[int], int, str]:
    prompt = template(history[:-1], True)
    turns = count_end_of_turn(prompt, {EOT})
    return prompt, turns, context_digest(prompt, {EOT}, turns)


def test_a_template_that_rerenders_earlier_turns_is_proved_by_the_history_rendering() -> None:
    """Why exact mode renders the history too: once a new user message follows, Qwen3's rule drops the reasoning of
    earlier assistant turns, so the parent's context no longer opens the new rendering; the history's rendering
    (without the new turns) still proves it, and the splice keeps the parent's ids."""
    history, new = _continuation(reasoning_after_last_user, "b")
    parent_prompt, parent_turns, parent_context = _parent_context(reasoning_after_last_user, history)
    rendered = reasoning_after_last_user(history + new, True)
    assert context_digest(rendered, {EOT}, parent_turns) != parent_context  # the parent's count alone would refuse
    by_history = reasoning_after_last_user(history, False)
    count = count_end_of_turn(by_history, {EOT})
    assert context_digest(by_history, {EOT}, count - 1) == parent_context
    parent_ids = [*parent_prompt, 40, EOT]
    spliced = splice_exact_prompt(rendered, history_eot_count=count, eot_ids={EOT}, parent_ids=parent_ids)
    assert spliced == [*parent_ids, NL, *reasoning_after_last_user(new, True)]


def test_a_reply_that_spells_the_end_of_turn_is_refused_not_spliced_inside() -> None:
    """A reply whose text spells the end-of-turn renders with two: the parent's count plus one would cut inside the
    reply and splice its tail in as prompt (silently wrong); the history's rendering counts both, so its context
    through all but the last no longer matches the parent's and the call is refused (a context change), never
    spliced wrong."""
    history, new = _continuation(chatml, "b<e>c")
    parent_prompt, parent_turns, parent_context = _parent_context(chatml, history)
    rendered = chatml(history + new, True)
    parent_ids = [*parent_prompt, 40, EOT]
    shortcut = splice_exact_prompt(rendered, history_eot_count=parent_turns + 1, eot_ids={EOT}, parent_ids=parent_ids)
    assert context_digest(rendered, {EOT}, parent_turns) == parent_context
    assert shortcut != [*parent_ids, NL, *chatml(new, True)]  # the reply's tail "c" ends up in the prompt
    by_history = chatml(history, False)
    count = count_end_of_turn(by_history, {EOT})
    assert count == parent_turns + 2
    assert context_digest(by_history, {EOT}, count - 1) != parent_context


def test_ignore_eos_end_of_turns_in_the_parent_are_not_counted() -> None:
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    new = [{"role": "tool", "content": "c"}]
    parent_ids = chatml(history[:1], True) + [20, EOT, 21, EOT, 22]  # ignore_eos: ends inside, no final EOT
    spliced = splice_exact_prompt(
        chatml(history + new, True), history_eot_count=2, eot_ids={EOT}, parent_ids=parent_ids
    )
    assert spliced == [*parent_ids, EOT, NL, *chatml(new, True)]


def test_refusals_name_the_check() -> None:
    rendered = chatml([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], True)
    with pytest.raises(SpliceError, match="fewer than the 3"):
        splice_exact_prompt(rendered, history_eot_count=3, eot_ids={EOT}, parent_ids=[1])
    with pytest.raises(SpliceError, match="at least 1"):
        splice_exact_prompt(rendered, history_eot_count=0, eot_ids={EOT}, parent_ids=[1])
    with pytest.raises(SpliceError, match="empty"):
        splice_exact_prompt(rendered, history_eot_count=1, eot_ids={EOT}, parent_ids=[])
    with pytest.raises(SpliceError, match="nothing is rendered"):
        splice_exact_prompt([5, EOT], history_eot_count=1, eot_ids={EOT}, parent_ids=[1])
    with pytest.raises(SpliceError, match="no assistant"):
        history_eot_count_by_messages([{"role": "user", "content": "a"}])
    assert last_assistant_index([{"role": "assistant"}, {"role": "tool"}]) == 0


# --- the end-of-turn scans: C scans that agree with the per-token definitions ------------------------------------


def _positions_by_definition(ids: Sequence[int], eot_ids: Collection[int]) -> list[int]:
    return [position for position, token in enumerate(ids) if token in eot_ids]


_SCAN_IDS = st.lists(st.integers(min_value=0, max_value=6), max_size=60)
_EOT_SETS = st.lists(st.integers(min_value=0, max_value=6), min_size=1, max_size=3)


@given(ids=_SCAN_IDS, eot_ids=_EOT_SETS)
def test_end_of_turn_scans_agree_with_their_definitions(ids: list[int], eot_ids: list[int]) -> None:
    """Positions and counts from ``list.index``/``list.count`` equal a per-token scan (repeated ids in the end-of-turn
    collection counted once)."""
    expected = _positions_by_definition(ids, eot_ids)
    assert end_of_turn_positions(ids, eot_ids) == expected
    assert end_of_turn_positions(tuple(ids), eot_ids) == expected
    assert count_end_of_turn(ids, eot_ids) == len(expected)


@given(ids=_SCAN_IDS, eot_ids=_EOT_SETS, turns=st.integers(min_value=0, max_value=8))
def test_the_context_digest_covers_the_ids_through_the_nth_end_of_turn(
    ids: list[int], eot_ids: list[int], turns: int
) -> None:
    positions = _positions_by_definition(ids, eot_ids)
    if len(positions) < turns:
        with pytest.raises(SpliceError, match=f"holds {len(positions)} end-of-turn ids"):
            context_digest(ids, eot_ids, turns)
        return
    end = positions[turns - 1] + 1 if turns else 0
    assert context_digest(ids, eot_ids, turns) == context_digest(
        ids[:end], eot_ids, count_end_of_turn(ids[:end], eot_ids)
    )


@given(ids=_SCAN_IDS, eot_ids=_EOT_SETS, count=st.integers(min_value=1, max_value=8))
def test_the_splice_boundary_is_the_nth_end_of_turn(ids: list[int], eot_ids: list[int], count: int) -> None:
    positions = _positions_by_definition(ids, eot_ids)
    parent = [9, 9]
    if len(positions) < count:
        with pytest.raises(SpliceError, match=f"holds {len(positions)} end-of-turn ids"):
            splice_exact_prompt(ids, history_eot_count=count, eot_ids=eot_ids, parent_ids=parent)
        return
    boundary = positions[count - 1]
    if boundary == len(ids) - 1:
        with pytest.raises(SpliceError, match="nothing is rendered"):
            splice_exact_prompt(ids, history_eot_count=count, eot_ids=eot_ids, parent_ids=parent)
        return
    spliced = splice_exact_prompt(ids, history_eot_count=count, eot_ids=eot_ids, parent_ids=parent)
    assert spliced == [*parent, ids[boundary], *ids[boundary + 1 :]]
    scanned = ScannedIds.of(ids, eot_ids).eot_positions
    assert (
        splice_exact_prompt(ids, history_eot_count=count, eot_ids=eot_ids, parent_ids=parent, eot_positions=scanned)
        == spliced
    )


_WIDE_IDS = st.lists(
    st.one_of(
        st.integers(min_value=0, max_value=6),
        st.sampled_from([256, 512, 2 << 16, 2 << 24, 2**31 - 1]),  # bytes that spell a small id across two ids
        st.integers(min_value=0, max_value=2**64 - 1),  # from 2**31: the reference path
    ),
    max_size=40,
)


@given(ids=_WIDE_IDS, eot_ids=_EOT_SETS, turns=st.integers(min_value=0, max_value=4))
def test_a_scan_gives_the_positions_bytes_and_digests_of_their_definitions(
    ids: list[int], eot_ids: list[int], turns: int
) -> None:
    """One scan of a rendering: the end-of-turn positions, the ids as ``encode_token_ids`` packs them, and the context
    digest ``sha256(domain || encode_token_ids(ids[:end]))``, whether the ids take the one-pass proof or not."""
    scanned = ScannedIds.of(ids, eot_ids)
    positions = _positions_by_definition(ids, eot_ids)
    assert scanned.ids == ids and scanned.eot_positions == positions
    assert scanned.ids_u64be == encode_token_ids(ids)[8:]
    if len(positions) < turns:
        with pytest.raises(SpliceError, match=f"holds {len(positions)} end-of-turn ids"):
            scanned.context_digest(turns)
        return
    end = positions[turns - 1] + 1 if turns else 0
    expected = hashlib.sha256(b"staging-sink-rendered-context-v1" + encode_token_ids(ids[:end])).hexdigest()
    assert scanned.context_digest(turns) == expected == context_digest(ids, eot_ids, turns)


def test_an_end_of_turn_spelled_across_two_ids_is_not_one() -> None:
    """512 then 256 are the bytes 00 02 00 00 00 01 00 00: id 2's little-endian bytes at offset 1, inside no id."""
    assert ScannedIds.of([512, 256], {2}).eot_positions == []
    assert ScannedIds.of([512, 2, 256, 2], {2}).eot_positions == [1, 3]


@pytest.mark.parametrize("ids", [[1, -1], [1, True], [1, 1.0], [2**64], [1, "2"]])
def test_a_scan_refuses_what_is_not_a_token_id(ids: list[Any]) -> None:
    with pytest.raises(ValueError, match="token ids must be"):
        ScannedIds.of(ids, {2})
