"""Engine payload adapters and install_capture (contract §5.1, §5.6)."""

from __future__ import annotations

import copy
import sys
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sink.contract.records import CaptureAdmission
from sink.store.memory import MemoryStagingStore
from sink_tools.simulated.engine import SimulatedEngine
from worker import CaptureAdapter, MegatronAdapter, RolloutTokenCapture, VLLMChatAdapter, install_capture
from worker.adapters import PREFIX_REQUEST_KEY, cross_checked, logprob_list, token_id_list
from worker.errors import EnginePayloadError


def vllm_payload(**choice_updates: Any) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": "hi"},
        "logprobs": {
            "content": [
                {"token": "token_id:22", "logprob": -0.3},
                {"token": "token_id:23", "logprob": -0.4},
            ]
        },
        "finish_reason": "stop",
    }
    choice.update(choice_updates)
    return {"id": "chatcmpl-1", "prompt_token_ids": [10, 11, 12], "choices": [choice]}


def test_adapters_satisfy_the_protocol() -> None:
    assert isinstance(VLLMChatAdapter(), CaptureAdapter)
    assert isinstance(MegatronAdapter(), CaptureAdapter)


def test_vllm_extraction() -> None:
    adapter = VLLMChatAdapter()
    payload = vllm_payload()
    assert adapter.extract_prompt_ids(payload) == [10, 11, 12]
    assert adapter.extract_generation(payload) == ([22, 23], [-0.3, -0.4])
    assert adapter.extract_extras(payload) is None
    experts = [[[1, 2]], [[3, 4]]]
    routed = vllm_payload(message={"role": "assistant", "content": "hi", "routed_experts": experts})
    assert adapter.extract_extras(routed) == {"routed_experts": experts}


def test_vllm_token_ids_on_the_choice_take_precedence() -> None:
    payload = vllm_payload(token_ids=[40, 41])
    payload["choices"][0]["logprobs"]["content"][0]["token"] = "Hello"  # a text token, ignored
    assert VLLMChatAdapter().extract_generation(payload) == ([40, 41], [-0.3, -0.4])
    with pytest.raises(ValueError, match="2 generated ids but 1"):
        short = vllm_payload(token_ids=[40, 41])
        del short["choices"][0]["logprobs"]["content"][1]
        VLLMChatAdapter().extract_generation(short)


def test_vllm_numeric_logprobs_become_python_floats() -> None:
    payload = vllm_payload()
    content = payload["choices"][0]["logprobs"]["content"]
    content[0]["logprob"] = -1
    content[1]["logprob"] = np.float32(-0.5)
    _, logprobs = VLLMChatAdapter().extract_generation(payload)
    assert logprobs == [-1.0, -0.5] and {type(value) for value in logprobs} == {float}


def _set(payload: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    target: Any = payload
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return payload


LP0 = ("choices", 0, "logprobs", "content", 0, "logprob")
TOKEN0 = ("choices", 0, "logprobs", "content", 0, "token")


@pytest.mark.parametrize(
    ("path", "value", "error"),
    [
        (LP0, True, EnginePayloadError),
        (LP0, "-0.3", EnginePayloadError),
        (LP0, None, EnginePayloadError),
        (TOKEN0, "token_id:-3", ValueError),
        (TOKEN0, "token_id:x", ValueError),
        (TOKEN0, "22", ValueError),
        (TOKEN0, 22, EnginePayloadError),
        (("prompt_token_ids",), [10, True], EnginePayloadError),
        (("prompt_token_ids",), [10, 11.0], EnginePayloadError),
        (("prompt_token_ids",), [10, -1], ValueError),
        (("prompt_token_ids",), "10 11", EnginePayloadError),
        (("choices", 0, "token_ids"), [40, False], EnginePayloadError),
        (("choices", 0, "logprobs"), None, ValueError),
    ],
)
def test_vllm_rejections(path: tuple[Any, ...], value: Any, error: type[Exception]) -> None:
    adapter = VLLMChatAdapter()
    payload = _set(vllm_payload(), path, value)
    with pytest.raises(error):
        adapter.extract_prompt_ids(payload)
        adapter.extract_generation(payload)


def test_vllm_rejects_missing_fields_and_n_above_one() -> None:
    adapter = VLLMChatAdapter()
    with pytest.raises(ValueError, match="prompt_token_ids"):
        adapter.extract_prompt_ids({"choices": []})
    two = vllm_payload()
    two["choices"].append(copy.deepcopy(two["choices"][0]))
    with pytest.raises(ValueError, match="exactly one choice"):
        adapter.extract_generation(two)
    with pytest.raises(ValueError, match="choices"):
        adapter.extract_extras({})


def test_enter_prefix_returns_a_copy() -> None:
    for adapter in (VLLMChatAdapter(), MegatronAdapter()):
        request = {"messages": [{"role": "user", "content": "x"}], PREFIX_REQUEST_KEY: [9]}
        entered = adapter.enter_prefix(request, [1, 2, 3])
        assert entered[PREFIX_REQUEST_KEY] == [1, 2, 3] and request[PREFIX_REQUEST_KEY] == [9]
        assert PREFIX_REQUEST_KEY not in adapter.enter_prefix(request, [])
        with pytest.raises(TypeError):
            adapter.enter_prefix(["not", "a", "mapping"], [1])
        with pytest.raises(EnginePayloadError):
            adapter.enter_prefix(request, [1, True])


def test_megatron_mapping_object_and_arrays() -> None:
    adapter = MegatronAdapter()
    mapping = {"prompt_tokens": [1, 2], "generated_tokens": [3, 4], "generated_log_probs": [-0.5, -1]}
    assert adapter.extract_prompt_ids(mapping) == [1, 2]
    assert adapter.extract_generation(mapping) == ([3, 4], [-0.5, -1.0])
    assert adapter.extract_extras(mapping) is None
    obj = SimpleNamespace(
        prompt_token_ids=np.array([1, 2], dtype=np.int64),
        generated_token_ids=np.array([3, 4], dtype=np.int64),
        log_probs=np.array([-0.5, -0.25], dtype=np.float32),
        routed_experts=np.array([[1, 2], [3, 4]]),
    )
    assert adapter.extract_prompt_ids(obj) == [1, 2]
    ids, logprobs = adapter.extract_generation(obj)
    assert ids == [3, 4] and logprobs == [-0.5, -0.25] and {type(v) for v in ids + logprobs} == {int, float}
    assert adapter.extract_extras(obj) == {"routed_experts": [[1, 2], [3, 4]]}


def test_megatron_full_token_sequence() -> None:
    adapter = MegatronAdapter()
    payload = {"tokens": [1, 2, 3, 4], "generated_token_ids": [3, 4], "log_probs": [-0.1, -0.2]}
    assert adapter.extract_prompt_ids(payload) == [1, 2]
    with pytest.raises(ValueError, match="does not end"):
        adapter.extract_prompt_ids({**payload, "tokens": [1, 2, 4, 3]})


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        ({"generated_tokens": [3, 4], "generated_log_probs": [-0.5]}, ValueError),
        ({"generated_tokens": [3, True], "generated_log_probs": [-0.5, -1.0]}, EnginePayloadError),
        ({"generated_tokens": [3, 4], "generated_log_probs": [-0.5, False]}, EnginePayloadError),
        ({"generated_tokens": [3, 4], "generated_log_probs": ["a", -1.0]}, EnginePayloadError),
        ({"generated_tokens": [3, 4]}, ValueError),
        ({"generated_tokens": 3, "generated_log_probs": [-0.5]}, EnginePayloadError),
    ],
)
def test_megatron_rejections(payload: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        MegatronAdapter().extract_generation(payload)


def test_conversion_helpers() -> None:
    assert token_id_list((1, 2)) == [1, 2]
    assert logprob_list([-1, -0.5]) == [-1.0, -0.5]
    with pytest.raises(EnginePayloadError):
        logprob_list([np.bool_(True)])
    with pytest.raises(EnginePayloadError):
        token_id_list([np.int64(3)])  # a bare numpy scalar is not an exact int


class _IntSubclass(int):
    """Equal to an int, yet not an exact int."""


_ODD_ITEMS = st.sampled_from([True, False, 1.0, -1, -(2**31), 2**31, 2**64, _IntSubclass(5), "7", None])


@given(
    ids=st.lists(st.integers(min_value=0, max_value=2**40), max_size=40),
    odd=st.one_of(st.none(), st.tuples(_ODD_ITEMS, st.integers(min_value=0, max_value=40))),
)
def test_token_id_list_accepts_exactly_the_non_negative_exact_ints(ids: list[int], odd: Any) -> None:
    """The one-pass fast path (ids below 2**31) and the general path agree with the rule itself."""
    values: list[Any] = list(ids)
    if odd is not None:
        item, position = odd
        values.insert(position % (len(values) + 1), item)
    valid = all(type(v) is int and v >= 0 for v in values)
    if valid:
        assert token_id_list(values) == values
    else:
        with pytest.raises(EnginePayloadError):
            token_id_list(values)


def test_complete_call_from_response_matches_complete_call() -> None:
    engine = SimulatedEngine(3)
    prompt = engine.tokenizer.render_chat([{"role": "user", "content": "hello"}])
    generation = engine.generate(prompt, 32)
    results = []
    for via_adapter in (False, True):
        capture = RolloutTokenCapture(sink=MemoryStagingStore(), weight_version_fn=lambda: 2, adapter=VLLMChatAdapter())
        call = capture.begin_call(CaptureAdmission(rollout_id="r", model_call_id="c", mode="text"))
        if via_adapter:
            coords = capture.complete_call_from_response(call, engine.chat_response(prompt, generation))
        else:
            coords = capture.complete_call(
                call,
                prompt_token_ids=prompt,
                generated_token_ids=generation.token_ids,
                generated_logprobs=generation.logprobs,
            )
        results.append(coords.model_dump())
    assert results[0] == results[1] and results[0]["disposition"] == "staged"


def test_adapter_failure_gives_failed_coords_and_claims_the_call() -> None:
    sink = MemoryStagingStore()
    capture = RolloutTokenCapture(sink=sink, weight_version_fn=lambda: 2, adapter=MegatronAdapter())
    admission = CaptureAdmission(rollout_id="r", model_call_id="c", mode="text")
    call = capture.begin_call(admission)
    coords = capture.complete_call_from_response(call, {"generated_tokens": [True]})
    assert coords.disposition == "capture_failed" and coords.delta_len == 0 and coords.staging_key is None
    assert len(sink) == 0 and call.completed
    with pytest.raises(Exception, match="already completed"):
        capture.complete_call_from_response(call, {"generated_tokens": [True]})


@pytest.mark.anyio
async def test_async_complete_from_response() -> None:
    engine = SimulatedEngine(4)
    prompt = engine.tokenizer.render_chat([{"role": "user", "content": "hello"}])
    generation = engine.generate(prompt, 16)
    capture = RolloutTokenCapture(sink=MemoryStagingStore(), weight_version_fn=lambda: 2, adapter=VLLMChatAdapter())
    call = await capture.abegin_call(CaptureAdmission(rollout_id="r", model_call_id="c", mode="text"))
    payload = engine.chat_response(prompt, generation, routed_experts=True)
    coords = await capture.acomplete_call_from_response(call, payload)
    assert coords.disposition == "staged" and coords.delta_len == len(prompt) + len(generation.token_ids)
    bad = await capture.abegin_call(CaptureAdmission(rollout_id="r", model_call_id="c2", mode="text"))
    assert (await capture.acomplete_call_from_response(bad, {"choices": []})).disposition == "capture_failed"


class ServingLayer:
    def __init__(self) -> None:
        self.installed: list[RolloutTokenCapture] = []

    def install_token_capture(self, capture: RolloutTokenCapture) -> None:
        self.installed.append(capture)


def test_install_capture() -> None:
    layer = ServingLayer()
    adapter = VLLMChatAdapter()
    capture = install_capture(layer, sink=MemoryStagingStore(), weight_version_fn=lambda: 1, adapter=adapter)
    assert layer.installed == [capture] and capture.adapter is adapter
    with pytest.raises(TypeError, match="StagingSink"):
        install_capture(layer, sink=object(), weight_version_fn=lambda: 1)
    with pytest.raises(TypeError, match="callable"):
        install_capture(layer, sink=MemoryStagingStore(), weight_version_fn=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="install_token_capture"):
        install_capture(object(), sink=MemoryStagingStore(), weight_version_fn=lambda: 1)
    with pytest.raises(TypeError, match="install_token_capture"):
        install_capture(
            SimpleNamespace(install_token_capture=3), sink=MemoryStagingStore(), weight_version_fn=lambda: 1
        )
    assert len(layer.installed) == 1


def _reference_cross_check(ids: list[int], tokens: Any) -> bool:
    """The reading of contract §5.1 without shortcuts: ``True`` when *ids* stand, ``False`` when they disagree."""
    if not isinstance(tokens, list) or not all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        return True
    parsed: list[int] = []
    for token in tokens:
        digits = token.removeprefix("token_id:")
        if not (digits.isdecimal() and digits.isascii()):
            return False  # cross_checked raises EnginePayloadError (malformed) for these: neither is trusted
        parsed.append(int(digits))
    return not tokens or parsed == ids


_TOKEN_STRINGS = st.one_of(
    st.integers(0, 2**40).map("token_id:{}".format),
    st.sampled_from(["token_id:007", "token_id:-1", "token_id: 5", "token_id:\uff15", "token_id:", "Hello", "7"]),
    st.integers(0, 9),
)


@given(ids=st.lists(st.integers(0, 2**40), max_size=6), tokens=st.lists(_TOKEN_STRINGS, max_size=6), same=st.booleans())
def test_cross_checked_agrees_with_the_per_token_reading(ids: list[int], tokens: list[Any], same: bool) -> None:
    # The whole-list comparison with vLLM's own strings is a shortcut: it must accept and refuse what the
    # per-token reading accepts and refuses (leading zeros still read as the same id; a sign never does).
    if same:
        tokens = ["token_id:" + str(i) for i in ids]
    if _reference_cross_check(ids, tokens):
        assert cross_checked(ids, tokens, "t") is ids
    else:
        with pytest.raises(EnginePayloadError):
            cross_checked(ids, tokens, "t")


@given(
    ids=st.lists(st.integers(0, 2**40), min_size=1, max_size=6),
    cuts=st.lists(st.integers(0, 200), max_size=8),
)
def test_cross_checked_judges_any_split_of_the_joined_spelling_as_the_per_token_reading(
    ids: list[int], cuts: list[int]
) -> None:
    """The shortcut compares joined strings: tokens that re-split vLLM's joined spelling elsewhere (one token holding
    two ids and an empty one, a prefix cut in half) are judged exactly as the per-token reading judges them."""
    joined = "".join(f"token_id:{i}" for i in ids)
    points = sorted({cut % (len(joined) + 1) for cut in cuts})
    tokens = [joined[a:b] for a, b in zip([0, *points], [*points, len(joined)], strict=True)]
    if _reference_cross_check(ids, tokens):
        assert cross_checked(ids, tokens, "t") is ids
    else:
        with pytest.raises(EnginePayloadError):
            cross_checked(ids, tokens, "t")


@pytest.mark.parametrize("orjson_installed", [True, False])
@pytest.mark.parametrize("ids", [[0, 7, 150_000], [2**31, 2**63, 2**64 - 1], [5, 2**64, 2**70]])
def test_vllms_own_strings_stand_and_one_other_id_does_not_with_or_without_orjson(
    ids: list[int], orjson_installed: bool
) -> None:
    """The shortcut spells the ids with orjson when the proxy extra brings it, else with ``str()``; ids orjson does
    not write (from ``2**64``) take the per-token reading. Each way, the same verdicts."""
    tokens = [f"token_id:{i}" for i in ids]
    others = [[*tokens[:k], f"token_id:{ids[k] + 1}", *tokens[k + 1 :]] for k in range(len(ids))]
    with patch.dict(sys.modules, {} if orjson_installed else {"orjson": None}):  # None: `import orjson` fails
        assert cross_checked(ids, tokens, "t") is ids
        assert cross_checked(ids, [*tokens[:-1], "token_id:0" + str(ids[-1])], "t") is ids  # a leading zero
        for other in others:
            with pytest.raises(EnginePayloadError, match="disagree"):
                cross_checked(ids, other, "t")


_TOO_MANY_DIGITS = "9" * (sys.get_int_max_str_digits() + 1)


@pytest.mark.parametrize("explicit_ids", [None, [5]])
def test_a_token_string_with_more_digits_than_int_reads_fails_the_call(explicit_ids: list[int] | None) -> None:
    """A ``token_id:`` string too long for ``int()`` (its digit limit) is a malformed payload like any other: the
    capture records the call failed, no ``ValueError`` from ``int()`` escapes with the call left open."""
    payload = vllm_payload(logprobs={"content": [{"token": "token_id:" + _TOO_MANY_DIGITS, "logprob": -0.5}]})
    if explicit_ids is not None:
        payload["choices"][0]["token_ids"] = explicit_ids
    with pytest.raises(EnginePayloadError, match="token"):
        VLLMChatAdapter().extract_generation(payload)
    sink = MemoryStagingStore()
    capture = RolloutTokenCapture(sink=sink, weight_version_fn=lambda: 2, adapter=VLLMChatAdapter())
    call = capture.begin_call(CaptureAdmission(rollout_id="r", model_call_id="c", mode="text"))
    assert capture.complete_call_from_response(call, payload).disposition == "capture_failed"
    assert call.completed and len(sink) == 0


def test_cross_checked_refuses_ids_with_more_digits_than_str_writes() -> None:
    huge = 10 ** len(_TOO_MANY_DIGITS) - 1  # what _TOO_MANY_DIGITS spells (int() refuses to read it)
    with pytest.raises(EnginePayloadError):
        cross_checked([huge], ["token_id:" + _TOO_MANY_DIGITS], "t")
    assert cross_checked([huge], ["text"], "t") == [huge]  # text tokens check nothing (the record refuses the id)


def _vllm_chat(ids: list[int], logprobs: list[float], tokens: list[Any], text: str) -> dict[str, Any]:
    content = [
        {"token": token, "logprob": lp, "bytes": None, "top_logprobs": []}
        for token, lp in zip(tokens, logprobs, strict=True)
    ]
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "token_ids": ids, "logprobs": {"content": content}}
    return {"id": "x", "prompt_token_ids": [1, 2], "choices": [choice]}


@given(
    ids=st.lists(st.integers(min_value=0, max_value=2**33), max_size=8),
    logprob=st.sampled_from([-0.5, -1, 0.0]),
    spelling=st.sampled_from(["ids", "text", "other ids", "bool"]),
    text=st.sampled_from(["", "hi"]),
)
def test_vllm_chat_read_directly_agrees_with_the_general_reading(
    ids: list[int], logprob: float, spelling: str, text: str
) -> None:
    """``VLLMChatAdapter.extract_generation`` reads vLLM's usual JSON directly; a payload whose ids are a tuple takes
    the general path. Both give the same ids and log-probs, or both refuse."""
    spellings: dict[str, list[Any]] = {
        "ids": [f"token_id:{t}" for t in ids],
        "text": ["x"] * len(ids),
        "other ids": [f"token_id:{t + 1}" for t in ids],
        "bool": [True] * len(ids),
    }
    tokens = spellings[spelling]
    logprobs = [logprob] * len(ids)
    outcomes: list[tuple[list[int], list[float]] | None] = []
    for container in (list, tuple):
        payload = _vllm_chat(container(ids), logprobs, tokens, text)  # type: ignore[arg-type]
        try:
            outcomes.append(VLLMChatAdapter().extract_generation(payload))
        except EnginePayloadError:
            outcomes.append(None)
    assert outcomes[0] == outcomes[1]
    if outcomes[0] is not None:
        assert outcomes[0] == (ids, [float(v) for v in logprobs])
