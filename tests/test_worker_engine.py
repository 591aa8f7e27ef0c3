"""The simulated engine and the rollout driver (tokenizer, generator, multi-turn rollouts)."""

from __future__ import annotations

import itertools
import math
from array import array

import pytest

from sink.contract.digest import compute_chain_hash, hash_token_ids
from sink.store.memory import MemoryStagingStore
from sink_tools.simulated.engine import (
    BYTE_OFFSET,
    IM_END,
    IM_START,
    ByteTokenizer,
    RolloutTrace,
    SimulatedEngine,
    simulate_rollout,
)
from worker import RolloutTokenCapture, VLLMChatAdapter


def test_tokenizer_round_trip_and_replacement_character() -> None:
    tokenizer = ByteTokenizer()
    text = "größe → 5 €, ok 🙂"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode()) and min(ids) >= BYTE_OFFSET
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd")  # cut inside the 4-byte emoji
    assert tokenizer.decode([IM_START, *tokenizer.encode("a"), IM_END]) == "a"
    with pytest.raises(ValueError):
        tokenizer.decode([BYTE_OFFSET + 256])


def test_chat_template() -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.render_chat([{"role": "user", "content": "hi"}])
    assert ids == [IM_START, *tokenizer.encode("user\nhi"), IM_END, IM_START, *tokenizer.encode("assistant\n")]
    assert tokenizer.render_chat([], add_generation_prompt=False) == []


def test_generation_is_deterministic_and_well_formed() -> None:
    prompt = [IM_START, 20, 21]
    first = [SimulatedEngine(11).generate(prompt, 64) for _ in range(3)]
    again = [SimulatedEngine(11).generate(prompt, 64) for _ in range(3)]
    assert first == again
    assert SimulatedEngine(12).generate(prompt, 64) != first[0]
    engine = SimulatedEngine(1)
    generations = [engine.generate(prompt, 48, min_tokens=8) for _ in range(40)]
    reasons = {generation.finish_reason for generation in generations}
    assert reasons == {"stop", "length"}
    for generation in generations:
        assert 8 <= len(generation.token_ids) <= 48
        assert len(generation.logprobs) == len(generation.token_ids)
        assert all(type(value) is float and math.isfinite(value) and value < 0 for value in generation.logprobs)
        if generation.finish_reason == "stop":
            assert generation.token_ids[-1] == IM_END
            assert "\ufffd" not in engine.tokenizer.decode(generation.token_ids)
        else:
            assert len(generation.token_ids) == 48
    values = list(itertools.chain.from_iterable(generation.logprobs for generation in generations))
    assert all(value == array("f", [value])[0] for value in values)  # float32 values, as vLLM's
    exact = SimulatedEngine(2).generate(prompt, 2048, min_tokens=2048)
    assert len(exact.token_ids) == 2048


def test_generate_rejects_bad_budgets() -> None:
    with pytest.raises(ValueError):
        SimulatedEngine().generate([1], 0)
    with pytest.raises(ValueError):
        SimulatedEngine().generate([1], 4, min_tokens=5)


def test_responses_parse_with_the_adapters() -> None:
    engine = SimulatedEngine(3)
    generation = engine.generate([IM_START, 30], 16)
    payload = engine.chat_response([IM_START, 30], generation, routed_experts=True)
    adapter = VLLMChatAdapter()
    assert adapter.extract_prompt_ids(payload) == [IM_START, 30]
    assert adapter.extract_generation(payload) == (generation.token_ids, generation.logprobs)
    extras = adapter.extract_extras(payload)
    assert extras is not None and len(extras["routed_experts"]) == len(generation.token_ids)
    assert engine.megatron_response([IM_START, 30], generation)["generated_tokens"] == generation.token_ids


def _check_staged_chains(trace: RolloutTrace, store: MemoryStagingStore) -> None:
    """Every staged call's chain concatenates to its full sequence and its hashes link."""
    for call in trace.staged_calls:
        assert call.coords is not None
        snapshots = store.fetch(list(call.staging_chain))
        ids = list(itertools.chain.from_iterable(snapshot.token_ids_delta for snapshot in snapshots))
        assert ids == call.full_token_ids
        running = None
        for snapshot in snapshots:
            running = compute_chain_hash(running, snapshot.token_ids_delta)
            assert snapshot.chain_hash == running
        assert call.coords.chain_hash == running
        assert call.coords.cumulative_hash == hash_token_ids(call.full_token_ids)
        generated = snapshots[-1].token_mask_delta.count(1.0)
        assert generated == len(call.generation.token_ids)


def test_rollout_with_retries_and_abandoned_branches() -> None:
    store = MemoryStagingStore()
    capture = RolloutTokenCapture(sink=store, weight_version_fn=lambda: 5)
    trace = simulate_rollout(
        capture,
        SimulatedEngine(9),
        rollout_id="roll-1",
        turns=6,
        max_tokens=40,
        retry_turns={2, 5},
        abandoned_branch_turns={3},
        branch_length=2,
    )
    roles = [call.role for call in trace.calls]
    assert roles.count("main") == 6 and roles.count("retried") == 2 and roles.count("branch") == 2
    assert len(trace.staged_calls) == len(trace.calls) == len(store) == 10
    parents = {call.admission.parent_call_id for call in trace.calls if call.admission is not None}
    retried = [call.model_call_id for call in trace.calls if call.role == "retried"]
    assert not parents.intersection(retried)  # retried attempts are childless siblings
    branch = [call for call in trace.calls if call.role == "branch"]
    assert branch[1].admission is not None and branch[1].admission.parent_call_id == branch[0].model_call_id
    assert branch[1].model_call_id not in parents  # the abandoned branch ends childless
    main = [call for call in trace.calls if call.role == "main"]
    assert trace.terminal_model_call_id == main[-1].model_call_id
    for earlier, later in itertools.pairwise(main):
        assert later.admission is not None and later.admission.parent_call_id == earlier.model_call_id
        assert later.request_items[: len(earlier.request_items)] == earlier.request_items
        assert earlier.response_items[0] in later.request_items
    assert {item["role"] for item in main[-1].request_items} >= {"system", "user", "assistant", "tool"}
    _check_staged_chains(trace, store)


def test_inline_chain_adapter_and_host_resolution_give_identical_coords() -> None:
    dumps = []
    for prefix_mode, use_adapter, host_resolves in [
        ("inline", False, False),
        ("chain", False, False),
        ("inline", True, False),
        ("chain", True, True),
    ]:
        store = MemoryStagingStore()
        capture = RolloutTokenCapture(
            sink=store,
            weight_version_fn=lambda: 1,
            source=None if host_resolves else store,
            adapter=VLLMChatAdapter(),
        )
        trace = simulate_rollout(
            capture,
            SimulatedEngine(4),
            rollout_id="roll-2",
            turns=5,
            retry_turns={3},
            prefix_mode=prefix_mode,  # type: ignore[arg-type]
            use_adapter=use_adapter,
            prefix_source=store if host_resolves else None,
        )
        _check_staged_chains(trace, store)
        if prefix_mode == "chain":
            assert all(c.admission and c.admission.staging_chain for c in trace.calls[1:])
        dumps.append([call.coords.model_dump_json() for call in trace.calls if call.coords is not None])
    assert dumps[0] == dumps[1] == dumps[2] == dumps[3]


def test_injected_failure_poisons_the_rest_of_the_rollout() -> None:
    store = MemoryStagingStore()
    capture = RolloutTokenCapture(sink=store, weight_version_fn=lambda: 3)
    trace = simulate_rollout(capture, SimulatedEngine(2), rollout_id="roll-3", turns=5, fail_turns={2})
    failed = trace.failed_calls
    assert [call.model_call_id for call in failed] == ["roll-3.c002"]
    assert failed[0].coords is not None and failed[0].coords.delta_len == 0
    later = trace.calls[3:]
    assert all(call.admission is None and call.coords is None for call in later)
    assert all(call.generation.token_ids for call in later)  # served uncaptured
    assert trace.terminal_model_call_id is None and len(store) == 2
    with pytest.raises(KeyError):
        trace.call("nope")
    assert trace.call("roll-3.c001").staged
    with pytest.raises(ValueError):
        simulate_rollout(capture, SimulatedEngine(), rollout_id="x", turns=0)
