"""``complete_call`` takes the engine's ids and log-probabilities as any sequence, and any id the contract allows
(exact ints in ``[0, 2**64)``, contract §3.3), with or without the sequence cache: tuples stage the contract's
check values as lists do, and ids from ``2**31`` up, which the one-pass delta build leaves to the reference
build, stage with the contract's hashes and columns."""

from __future__ import annotations

import pytest

from sink.contract.digest import compute_chain_hash, hash_token_ids
from sink.store.memory import MemoryStagingStore
from tests.helpers.capture import (
    CHILD_CHAIN,
    CHILD_CUMULATIVE,
    CHILD_DIGEST,
    CHILD_GEN,
    CHILD_LPS,
    CHILD_PROMPT,
    ROOT_CHAIN,
    ROOT_CUMULATIVE,
    ROOT_DIGEST,
    ROOT_GEN,
    ROOT_LPS,
    ROOT_PROMPT,
    child_admission,
    make_capture,
    root_admission,
)

CACHES = pytest.mark.parametrize("cached_rollouts", [64, 0], ids=["sequence-cache", "no-cache"])


@CACHES
def test_tuples_stage_the_contract_check_values(cached_rollouts: int) -> None:
    capture = make_capture(sequence_cache_rollouts=cached_rollouts)
    root = capture.complete_call(
        capture.begin_call(root_admission()),
        prompt_token_ids=tuple(ROOT_PROMPT),
        generated_token_ids=tuple(ROOT_GEN),
        generated_logprobs=tuple(ROOT_LPS),
    )
    child = capture.complete_call(
        capture.begin_call(child_admission(root, ROOT_PROMPT + ROOT_GEN, "c2")),
        prompt_token_ids=tuple(CHILD_PROMPT),
        generated_token_ids=tuple(CHILD_GEN),
        generated_logprobs=tuple(CHILD_LPS),
    )
    assert (root.digest, root.chain_hash, root.cumulative_hash) == (ROOT_DIGEST, ROOT_CHAIN, ROOT_CUMULATIVE)
    assert (child.digest, child.chain_hash, child.cumulative_hash) == (CHILD_DIGEST, CHILD_CHAIN, CHILD_CUMULATIVE)


@CACHES
def test_ids_from_two_to_the_31_up_stage_with_the_contract_hashes(cached_rollouts: int) -> None:
    store = MemoryStagingStore()
    capture = make_capture(store, sequence_cache_rollouts=cached_rollouts)
    root_prompt, root_gen = [10, 2**31], [2**40]
    root = capture.complete_call(
        capture.begin_call(root_admission()),
        prompt_token_ids=root_prompt,
        generated_token_ids=root_gen,
        generated_logprobs=[-0.25],
    )
    child_prompt, child_gen = [*root_prompt, *root_gen, 2**64 - 1], [2**33]
    child = capture.complete_call(
        capture.begin_call(child_admission(root, root_prompt + root_gen, "c2")),
        prompt_token_ids=child_prompt,
        generated_token_ids=child_gen,
        generated_logprobs=[-0.5],
    )
    assert (root.disposition, child.disposition) == ("staged", "staged")
    assert root.chain_hash == compute_chain_hash(root_admission().parent_chain_hash, [10, 2**31, 2**40])
    assert child.chain_hash == compute_chain_hash(root.chain_hash, [2**64 - 1, 2**33])
    assert child.cumulative_hash == hash_token_ids(child_prompt + child_gen)
    assert (child.prev_len, child.delta_len, child.cum_len) == (3, 2, 5)
    (staged,) = store.fetch(["rollout-1/c2"])
    assert staged.token_ids_delta == [2**64 - 1, 2**33]
    assert staged.token_mask_delta == [0.0, 1.0]
    assert staged.generation_log_probs_delta == [0.0, -0.5]
