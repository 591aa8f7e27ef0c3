"""How the simulated engine behaves (:class:`sink_tools.simulated.http_app.EngineApp`; ``staging-sink engine`` flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sink_tools.simulated.chat_extras import ReasoningField, RoutedExpertsPlace

__all__ = ("EngineOptions",)


@dataclass(frozen=True)
class EngineOptions:
    """How the HTTP engine behaves."""

    seed: int = 0
    shape: Literal["vllm", "nemo-gym"] = "vllm"
    """``nemo-gym``: NeMo Gym's message-level token fields on ``choices[0].message``."""
    honour_prefix: bool = False
    """Start the prompt with ``required_prefix_token_ids`` (a NeMo RL generation server)."""
    drift: bool = False
    """Re-tokenize earlier assistant text differently (a space becomes a merged token)."""
    delay_s: float = 0.0
    """Latency added to every generation (timeout tests)."""
    default_max_tokens: int = 16
    """At most this many ids for ``/v1/completions`` and ``/v1/responses`` without a limit (the chat route, as
    vLLM's, may fill the context)."""
    scale_out: bool = False
    """Serve the token-in/token-out routes (vLLM's ``--enable-scale-out``)."""
    max_model_len: int = 1 << 20
    """Context length: a longer prompt is a 400 on every route."""
    reasoning_field: ReasoningField | None = None
    """A reasoning model and parser (vLLM's ``deepseek_r1``): generations hold ``</think>`` mid-text, and chat and
    derender answers carry the text before it in this message field (:mod:`sink_tools.simulated.parsers`)."""
    tool_calls: bool = False
    """A chat request naming ``tools`` (``tool_choice`` absent or ``auto``) generates a pythonic call of its first
    tool, ``[name()]``, which the tool-call parser answers as ``message.tool_calls`` (without it, a generation holds
    a call only when constrained to one, e.g. ``structured_outputs: {"choice": ["[lookup(q='x')]"]}``)."""
    routed_experts: RoutedExpertsPlace | None = None
    """Chat answers carry ``routed_experts`` here (``choice``: base64 ``.npy``, as vLLM 0.32)."""
