"""Entries and a Gym-shaped call order for the NeMo Gym transport's tests (written from the interface facts)."""

from __future__ import annotations

import random
import struct
from typing import Any

from sink.gym import LocalTokenEntry


def f32(value: float) -> float:
    """*value* rounded to float32, as an engine's log-probabilities are."""
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


def make_entry(
    rollout_id: str, model_call_id: str, *, n_tokens: int = 16, n_prompt: int = 8, seed: int = 0, **fields: Any
) -> LocalTokenEntry:
    """A valid entry with deterministic token arrays (*seed* varies them)."""
    rng = random.Random(f"{rollout_id}/{model_call_id}/{seed}")
    values: dict[str, Any] = {
        "rollout_id": rollout_id,
        "model_call_id": model_call_id,
        "model": "policy",
        "prompt_token_ids": [rng.randrange(150_000) for _ in range(n_prompt)],
        "generation_token_ids": [rng.randrange(150_000) for _ in range(n_tokens)],
        "generation_log_probs": [f32(-rng.random() * 5) for _ in range(n_tokens)],
        "output_items": [{"type": "message", "content": [{"type": "output_text", "text": "hi"}]}],
        "token_item_index": 0,
        "created_at": 1_700_000_000.5,
    }
    return LocalTokenEntry(**{**values, **fields})
