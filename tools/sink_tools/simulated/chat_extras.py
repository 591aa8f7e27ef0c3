"""Optional parts of the simulated engine's ``/v1/chat/completions`` answer, shaped as real engines send them.

(The reasoning and tool-call parsers are :mod:`sink_tools.simulated.parsers`.)

* ``routed_experts``: vLLM 0.32 puts it on the **choice** as base64 of a ``.npy`` array shaped
  ``(num_tokens - 1, layers, k)`` (prompt and generated tokens, without the last); older engines (and NeMo Gym's
  model server) on the message as nested lists, one ``[layers][k]`` entry per generated id;
* the end-of-turn ``logit_bias``: ``>= 50`` forces an empty reply, ``<= -50`` forbids one (as on the scale-out
  routes, :mod:`sink_tools.simulated.scale_out`).
"""

from __future__ import annotations

import base64
import io
from typing import Any, Literal

import numpy as np

from sink_tools.simulated.engine import IM_END, Generation

__all__ = (
    "EXPERTS_PER_TOKEN",
    "EXPERT_LAYERS",
    "ReasoningField",
    "RoutedExpertsPlace",
    "add_routed_experts",
    "eot_bias",
    "forced_empty",
    "min_tokens_of",
    "routed_experts_array",
)

ReasoningField = Literal["reasoning", "reasoning_content"]
RoutedExpertsPlace = Literal["choice", "message"]
EXPERT_LAYERS = 2
EXPERTS_PER_TOKEN = 2
_FORCE_BIAS = 50.0


def eot_bias(request: dict[str, Any]) -> float:
    """The request's ``logit_bias`` on the end-of-turn id (0 when none)."""
    bias = request.get("logit_bias")
    if not isinstance(bias, dict):
        return 0.0
    value = bias.get(str(IM_END), 0.0)
    return float(value) if isinstance(value, int | float) else 0.0


def forced_empty(request: dict[str, Any]) -> bool:
    """Whether the request forces an empty reply (its first sampled id is the end-of-turn)."""
    return eot_bias(request) >= _FORCE_BIAS


def min_tokens_of(request: dict[str, Any], min_tokens: int) -> int:
    """*min_tokens*, raised to 2 when the request forbids an empty reply (one id besides the end-of-turn)."""
    return max(min_tokens, 2) if eot_bias(request) <= -_FORCE_BIAS else min_tokens


def routed_experts_array(token_ids: list[int]) -> np.ndarray[Any, np.dtype[np.int32]]:
    """A deterministic ``(len(token_ids), layers, k)`` routing of *token_ids* (int32)."""
    ids = np.asarray(token_ids, dtype=np.int32).reshape(-1, 1, 1)
    layers = np.arange(EXPERT_LAYERS, dtype=np.int32).reshape(1, -1, 1)
    slots = np.arange(EXPERTS_PER_TOKEN, dtype=np.int32).reshape(1, 1, -1)
    return np.asarray((ids * 7 + layers * 3 + slots) % 8, dtype=np.int32)


def _npy_base64(array: np.ndarray[Any, Any]) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def add_routed_experts(
    payload: dict[str, Any], prompt: list[int], generation: Generation, place: RoutedExpertsPlace | None
) -> None:
    """Add ``routed_experts`` to a chat-completion *payload* where *place* says (in place; ``None``: nowhere)."""
    choice = payload["choices"][0]
    if place == "choice":
        sequence = [*prompt, *generation.token_ids][:-1]
        choice["routed_experts"] = _npy_base64(routed_experts_array(sequence))
    elif place == "message":
        choice["message"]["routed_experts"] = routed_experts_array(generation.token_ids).tolist()
