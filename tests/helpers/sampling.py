"""Sampling-provenance test data: ``extras["sampling"]`` entries as the capture proxy writes them, and a strategy."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from sink.contract.sampling import SAMPLING_EXTRAS_KEY

__all__ = ("sampling_entries", "sampling_entry", "sampling_extras")


def sampling_entry(**overrides: Any) -> dict[str, Any]:
    """An unconstrained engine entry (temperature 1, nothing else set), with *overrides*."""
    entry: dict[str, Any] = {
        "source": "engine",
        "temperature": 1.0,
        "top_p": None,
        "top_k": None,
        "min_p": None,
        "presence_penalty": None,
        "frequency_penalty": None,
        "repetition_penalty": None,
        "seed": None,
        "max_tokens": 16,
        "min_tokens": 0,
        "ignore_eos": False,
        "logit_bias": False,
        "constraint": None,
        "logprobs_mode": None,
    }
    entry.update(overrides)
    return entry


def sampling_extras(**overrides: Any) -> dict[str, Any]:
    """Extras holding :func:`sampling_entry` (*overrides*) beside another key, as a real call's may."""
    return {SAMPLING_EXTRAS_KEY: sampling_entry(**overrides), "routed_experts": None}


_floats = st.none() | st.floats(0.0, 4.0, allow_nan=False)
_ints = st.none() | st.integers(-1, 2**31)
sampling_entries = st.builds(
    sampling_entry,
    source=st.sampled_from(["engine", "request"]),
    temperature=_floats,
    top_p=_floats,
    top_k=_ints,
    min_p=_floats,
    presence_penalty=_floats,
    frequency_penalty=_floats,
    repetition_penalty=_floats,
    seed=_ints,
    max_tokens=_ints,
    min_tokens=st.integers(0, 12),
    ignore_eos=st.booleans(),
    logit_bias=st.booleans(),
    constraint=st.sampled_from([None, "structured_outputs", "tool_choice"]),
    logprobs_mode=st.sampled_from([None, "raw_logprobs", "processed_logprobs", "raw_logits"]),
)
"""Valid ``extras["sampling"]`` entries."""
