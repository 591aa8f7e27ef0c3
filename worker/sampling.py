"""A captured call's sampling provenance (:class:`sink.contract.sampling.SamplingProvenance`), as the proxy knows it.

In exact-prefix mode it is the engine's own: the generate request's ``sampling_params``, which vLLM's render route
resolved (the model's generation-config defaults applied; a field vLLM leaves out holds its ``SamplingParams``
default), with ``source="engine"``. In verify mode only the agent's request is known: its values, ``None`` where it
set none (the engine's default applied), with ``source="request"``. Either way the tool choice comes from the
request: a named or ``required`` one is decoded under a grammar (``constraint="tool_choice"``), as is a
``response_format`` other than text or ``structured_outputs`` (``"structured_outputs"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sink.contract.sampling import Constraint, SamplingProvenance, SamplingSource

__all__ = ("sampling_from_engine", "sampling_from_request")

_ENGINE_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "seed": None,
    "min_tokens": 0,
    "ignore_eos": False,
}
"""vLLM's ``SamplingParams`` defaults: the values its serialized ``sampling_params`` leaves out."""


def _constraint(request: Mapping[str, Any], structured: bool) -> Constraint | None:
    choice = request.get("tool_choice")
    if isinstance(choice, dict) or choice == "required":
        return "tool_choice"
    response_format = request.get("response_format")
    if structured or (isinstance(response_format, dict) and response_format.get("type") not in (None, "text")):
        return "structured_outputs"
    return None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _provenance(values: Mapping[str, Any], request: Mapping[str, Any], source: SamplingSource) -> dict[str, Any]:
    provenance = SamplingProvenance(
        source=source,
        temperature=_float(values.get("temperature")),
        top_p=_float(values.get("top_p")),
        top_k=_int(values.get("top_k")),
        min_p=_float(values.get("min_p")),
        presence_penalty=_float(values.get("presence_penalty")),
        frequency_penalty=_float(values.get("frequency_penalty")),
        repetition_penalty=_float(values.get("repetition_penalty")),
        seed=_int(values.get("seed")),
        max_tokens=_int(values.get("max_tokens")),
        min_tokens=_int(values.get("min_tokens")) or 0,
        ignore_eos=values.get("ignore_eos") is True,
        logit_bias=bool(values.get("logit_bias") or values.get("allowed_token_ids") or values.get("bad_words")),
        constraint=_constraint(request, values.get("structured_outputs") is not None),
        logprobs_mode=None,  # vLLM 0.32 does not report its --logprobs-mode
    )
    return provenance.as_extras()


def sampling_from_engine(params: Mapping[str, Any], request: Mapping[str, Any]) -> dict[str, Any]:
    """The ``extras["sampling"]`` entry of an exact-prefix call from its generate request's ``sampling_params``."""
    return _provenance({**_ENGINE_DEFAULTS, **params}, request, "engine")


def sampling_from_request(request: Mapping[str, Any]) -> dict[str, Any]:
    """The ``extras["sampling"]`` entry of a verify-mode call: the agent's request as sent."""
    limit = request.get("max_completion_tokens", request.get("max_tokens"))
    return _provenance({**request, "max_tokens": limit}, request, "request")
