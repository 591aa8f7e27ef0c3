"""Sampling provenance: how a captured call's tokens were sampled, staged in its extras under ``"sampling"``.

The staged log-probs are what the engine reported. Whether they are the policy's own log-probs of tokens sampled
from the policy depends on how the call was sampled: a grammar constraint (structured outputs, a named or required
``tool_choice``) makes vLLM report the constrained distribution's log-probs (grammar-forced tokens come back as
0.0); a ``logit_bias`` (or ``allowed_token_ids`` / ``bad_words``) reshapes the distribution the token was drawn from
without changing the reported (raw) log-prob; ``min_tokens`` forbids the end-of-turn for the first positions. So every
staged call records, in its extras (the extras digest covers them), the effective sampling parameters:

* ``source``: ``"engine"`` in exact-prefix mode (the engine's own resolved parameters, from its render route: the
  model's generation-config defaults applied), ``"request"`` in verify mode (the agent's request as sent; a field it
  did not set is ``None``: the engine's default applied);
* ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``presence_penalty``, ``frequency_penalty``,
  ``repetition_penalty``, ``seed``, ``max_tokens``, ``min_tokens``, ``ignore_eos``;
* ``logit_bias``: ``True`` when a ``logit_bias``, ``allowed_token_ids`` or ``bad_words`` reshaped the distribution;
* ``constraint``: ``None``, ``"structured_outputs"`` (``response_format`` other than text, ``structured_outputs``) or
  ``"tool_choice"`` (a named or ``"required"`` tool choice: vLLM decodes it under a JSON-schema grammar);
* ``logprobs_mode``: the engine's log-prob mode where it reports one (vLLM 0.32 does not: ``None``).

The trainer side reads it back (:mod:`sink.trainer` policy mask, ``export``'s ``sampling`` column).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

__all__ = ("SAMPLING_EXTRAS_KEY", "sampling_from_engine", "sampling_from_request")

SAMPLING_EXTRAS_KEY = "sampling"

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
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INTS = ("top_k", "seed", "max_tokens")


def _constraint(request: Mapping[str, Any], structured: bool) -> Literal["structured_outputs", "tool_choice"] | None:
    choice = request.get("tool_choice")
    if isinstance(choice, dict) or choice == "required":
        return "tool_choice"
    response_format = request.get("response_format")
    if structured or (isinstance(response_format, dict) and response_format.get("type") not in (None, "text")):
        return "structured_outputs"
    return None


def _number(value: Any, kind: type) -> Any:
    """*value* as a float or int for the extras (exact types matter to the extras digest), ``None`` if absent."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if kind is float else int(value)


def _provenance(values: Mapping[str, Any], request: Mapping[str, Any], source: str, structured: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"source": source}
    out.update({name: _number(values.get(name), float) for name in _FLOATS})
    out.update({name: _number(values.get(name), int) for name in _INTS})
    out["min_tokens"] = _number(values.get("min_tokens"), int) or 0
    out["ignore_eos"] = values.get("ignore_eos") is True
    out["logit_bias"] = bool(values.get("logit_bias") or values.get("allowed_token_ids") or values.get("bad_words"))
    out["constraint"] = _constraint(request, structured)
    out["logprobs_mode"] = None
    return out


def sampling_from_engine(params: Mapping[str, Any], request: Mapping[str, Any]) -> dict[str, Any]:
    """The provenance of an exact-prefix call from the generate request's ``sampling_params`` (what the engine
    sampled with; fields vLLM leaves out hold its defaults) and the agent's *request* (the tool choice)."""
    values = {**_ENGINE_DEFAULTS, **params}
    return _provenance(values, request, "engine", params.get("structured_outputs") is not None)


def sampling_from_request(request: Mapping[str, Any]) -> dict[str, Any]:
    """The provenance of a verify-mode call: the agent's request as sent (unset fields ``None``)."""
    values = {**request, "max_tokens": request.get("max_completion_tokens", request.get("max_tokens"))}
    return _provenance(values, request, "request", request.get("structured_outputs") is not None)
