"""Builders of valid staged records for sink, source and end-to-end tests."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from sink.contract.digest import compute_chain_hash, compute_extras_digest, hash_token_ids
from sink.contract.records import StagedCallRecord

__all__ = ("make_chain", "make_record", "record_of_tokens")


def make_record(
    rollout_id: str = "r1",
    model_call_id: str = "c1",
    *,
    n_tokens: int = 8,
    carry: int = 2,
    parent: StagedCallRecord | None = None,
    parent_prefix: list[int] | None = None,
    weight_version: int = 0,
    extras: dict[str, Any] | None = None,
    seed: int = 0,
) -> StagedCallRecord:
    """A valid record: *carry* prompt tokens (mask 0.0) then generated tokens (mask 1.0).

    With *parent*, the record is its child (``token_in``); *parent_prefix* is
    the parent's full sequence (defaults to a sequence of the right length).
    """
    rng = random.Random(f"{rollout_id}/{model_call_id}/{seed}")
    ids = [rng.randrange(0, 150_000) for _ in range(n_tokens)]
    logprobs = [-rng.random() * 5 for _ in range(n_tokens - carry)]
    return record_of_tokens(
        rollout_id, model_call_id, ids, carry, logprobs, parent=parent, parent_prefix=parent_prefix,
        weight_version=weight_version, extras=extras,
    )  # fmt: skip


def record_of_tokens(
    rollout_id: str,
    model_call_id: str,
    ids: Sequence[int],
    carry: int,
    generated_logprobs: Sequence[float],
    *,
    parent: StagedCallRecord | None = None,
    parent_prefix: list[int] | None = None,
    weight_version: int = 0,
    extras: dict[str, Any] | None = None,
) -> StagedCallRecord:
    """The record of *ids*: the first *carry* are prompt tokens (mask 0.0, log-prob 0.0), the rest generated ones
    with *generated_logprobs*; *parent* and *parent_prefix* as :func:`make_record`'s."""
    ids = list(ids)
    mask = [0.0] * carry + [1.0] * (len(ids) - carry)
    logprobs = [0.0] * carry + list(generated_logprobs)
    if parent is None:
        prev_len, parent_id, parent_chain, prefix = 0, None, None, []
    else:
        prev_len, parent_id, parent_chain = parent.cum_len, parent.model_call_id, parent.chain_hash
        prefix = parent_prefix if parent_prefix is not None else list(range(parent.cum_len))
    return StagedCallRecord.from_components(
        rollout_id=rollout_id,
        model_call_id=model_call_id,
        parent_call_id=parent_id,
        mode="text" if parent is None else "token_in",
        prev_len=prev_len,
        delta_len=len(ids),
        cum_len=prev_len + len(ids),
        weight_version=weight_version,
        token_ids_delta=ids,
        token_mask_delta=mask,
        generation_log_probs_delta=logprobs,
        extras=extras,
        extras_digest=compute_extras_digest(extras),
        chain_hash=compute_chain_hash(parent_chain, ids),
        cumulative_hash=hash_token_ids(prefix + ids),
    )


def make_chain(
    rollout_id: str, calls: int, *, n_tokens: int = 8, extras: Sequence[dict[str, Any] | None] | None = None
) -> list[StagedCallRecord]:
    """A linear chain root -> c1 -> ... with consistent chain and cumulative hashes (*extras*: one per call)."""
    chain: list[StagedCallRecord] = []
    sequence: list[int] = []
    for index in range(calls):
        parent = chain[-1] if chain else None
        record = make_record(
            rollout_id,
            f"c{index}",
            n_tokens=n_tokens,
            carry=2 if index else 3,
            parent=parent,
            parent_prefix=list(sequence),
            extras=None if extras is None else extras[index],
        )
        sequence += record.token_ids_delta
        chain.append(record)
    return chain
