"""vLLM 0.32's token-in/token-out routes on the simulated engine, with the shapes the real server answers.

``/v1/chat/completions/render`` (a chat request to a generate request: templated ``token_ids`` plus
``sampling_params``), ``/inference/v1/generate`` (from ``token_ids``, streaming or not: per choice ``token_ids``,
log-probs with integer ids, ``finish_reason``, ``stop_reason``, ``weight_versions`` spans) and
``/v1/chat/completions/derender`` (a generate answer, or one streamed chunk plus a carried ``stream_state``, back to
a chat completion), plus ``GET /weight_info`` and ``POST /update_weight_version``. ``tests/test_engine_scale_out.py``
runs the same assertions against both engines. Sampling honours ``max_tokens``, ``min_tokens``, ``stop`` strings
(the ids keep the token that completed the string, the text drops it), ``ignore_eos`` (end-of-turn ids stay inside
the output) and a ``logit_bias`` on the end-of-turn id (``>= 50`` forces an empty reply, ``<= -50`` forbids it).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from worker.simulated.engine import BYTE_OFFSET, IM_END, FinishReason, Generation, SimulatedEngine

__all__ = ("SCALE_OUT_DISABLED", "BadScaleOutRequest", "SamplingParams", "ScaleOut", "sampling_of_chat")

SCALE_OUT_DISABLED = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
_FORCE_BIAS = 50.0


class BadScaleOutRequest(ValueError):
    """A request the real engine answers with 400 ``BadRequestError``."""


@dataclass(frozen=True)
class SamplingParams:
    """The sampling parameters the simulated engine honours."""

    max_tokens: int
    min_tokens: int = 0
    logprobs: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    eot_bias: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The ``sampling_params`` object of a generate request."""
        bias = {str(IM_END): self.eot_bias} if self.eot_bias else None
        return {
            "max_tokens": self.max_tokens,
            "min_tokens": self.min_tokens,
            "logprobs": self.logprobs,
            "stop": list(self.stop),
            "stop_token_ids": [],
            "ignore_eos": self.ignore_eos,
            "logit_bias": bias,
            "temperature": 1.0,
        }

    @classmethod
    def from_json(cls, raw: Any) -> SamplingParams:
        """Parse a generate request's ``sampling_params``.

        :raises BadScaleOutRequest: not an object, or bad counts.
        """
        if not isinstance(raw, dict):
            raise BadScaleOutRequest("sampling_params must be an object")
        stop = raw.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        bias = raw.get("logit_bias") or {}
        params = cls(
            max_tokens=raw.get("max_tokens") or 16,
            min_tokens=raw.get("min_tokens") or 0,
            logprobs=raw.get("logprobs"),
            stop=stop,
            ignore_eos=bool(raw.get("ignore_eos")),
            eot_bias=float(bias.get(str(IM_END), bias.get(IM_END, 0.0))),
        )
        if type(params.max_tokens) is not int or params.max_tokens < 1 or params.min_tokens > params.max_tokens:
            raise BadScaleOutRequest(f"need 1 <= max_tokens and min_tokens <= max_tokens, got {raw}")
        if not all(isinstance(s, str) and s for s in params.stop):
            raise BadScaleOutRequest("stop must be a string or a list of non-empty strings")
        return params


def sampling_of_chat(request: dict[str, Any], default_max_tokens: int) -> SamplingParams:
    """The sampling parameters of a chat-completions request (as render fills them in)."""
    keys = ("max_completion_tokens", "max_tokens")
    max_tokens = next((request[k] for k in keys if request.get(k) is not None), default_max_tokens)
    bias = request.get("logit_bias") or {}
    return SamplingParams.from_json(
        {
            "max_tokens": max_tokens,
            "min_tokens": request.get("min_tokens") or 0,
            "logprobs": (request.get("top_logprobs") or 0) if request.get("logprobs") else None,
            "stop": request.get("stop") or (),
            "ignore_eos": request.get("ignore_eos"),
            "logit_bias": {str(IM_END): bias.get(str(IM_END), 0.0)} if bias else None,
        }
    )


class ScaleOut:
    """The routes' logic over one :class:`SimulatedEngine` (the HTTP app dispatches to it)."""

    def __init__(self, engine: SimulatedEngine, max_model_len: int) -> None:
        self.engine = engine
        self.max_model_len = max_model_len
        self.weight_version = "default"
        self._ids = itertools.count(1)

    def check_length(self, prompt: Sequence[int]) -> None:
        """:raises BadScaleOutRequest: *prompt* leaves no room for output in the context (as vLLM answers)."""
        if len(prompt) >= self.max_model_len:
            raise BadScaleOutRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"contains at least {len(prompt)} input tokens. Please reduce the length of the input prompt."
            )

    def check_max_tokens(self, request: dict[str, Any]) -> None:
        """:raises BadScaleOutRequest: a chat request's ``max_tokens`` over the context (render and chat refuse it)."""
        for key in ("max_completion_tokens", "max_tokens"):
            value = request.get(key)
            if type(value) is int and value > self.max_model_len:
                raise BadScaleOutRequest(
                    f"{key}={value} cannot be greater than max_model_len={self.max_model_len}. "
                    "Please request fewer output tokens."
                )

    def render(self, request: dict[str, Any], token_ids: list[int], default_max_tokens: int) -> dict[str, Any]:
        """The generate request of a chat request whose template rendered *token_ids*."""
        self.check_length(token_ids)
        self.check_max_tokens(request)
        return {
            "request_id": f"chatcmpl-sim-{next(self._ids)}",
            "token_ids": token_ids,
            "sampling_params": sampling_of_chat(request, default_max_tokens).to_json(),
            "model": request.get("model") or "simulated",
            "output_mode": "tokens",
            "stream": bool(request.get("stream")),
            "stream_options": request.get("stream_options"),
        }

    def sample(self, prompt: Sequence[int], params: SamplingParams) -> tuple[Generation, str | None]:
        """Generate under *params*; returns the generation and its ``stop_reason`` (the stop string, if any)."""
        if params.eot_bias >= _FORCE_BIAS:
            return Generation([IM_END], [-0.015625], "stop"), None
        ids: list[int] = []
        logprobs: list[float] = []
        while len(ids) < params.max_tokens:
            floor = max(params.min_tokens - len(ids), 1)
            part = self.engine.generate([*prompt, *ids], params.max_tokens - len(ids), min_tokens=floor)
            body = part.token_ids
            if params.eot_bias <= -_FORCE_BIAS and body[-1] == IM_END:
                body = [*body[:-1], BYTE_OFFSET + 0x20]
            ids += body
            logprobs += part.logprobs
            if body[-1] == IM_END and not params.ignore_eos:
                break
        finish: FinishReason = "stop" if ids[-1] == IM_END and not params.ignore_eos else "length"
        if not params.stop:  # nothing to look for: skip the per-prefix decode (quadratic in the output length)
            return Generation(ids, logprobs, finish), None
        for end in range(1, len(ids) + 1):
            text = self.engine.tokenizer.decode(ids[:end])
            hit = next((stop for stop in params.stop if stop in text), None)
            if hit is not None:
                return Generation(ids[:end], logprobs[:end], "stop"), hit
        return Generation(ids, logprobs, finish), None

    def choice(self, generation: Generation, stop_reason: str | None, *, final: bool = True) -> dict[str, Any]:
        """A generate choice carrying *generation*'s ids (``weight_versions`` on the final one only)."""
        content = [
            {"token_id": token, "logprob": logprob, "rank": 1, "top_logprobs": []}
            for token, logprob in zip(generation.token_ids, generation.logprobs, strict=True)
        ]
        return {
            "index": 0,
            "finish_reason": generation.finish_reason if final else None,
            "stop_reason": stop_reason if final else None,
            "token_ids": generation.token_ids,
            "routed_experts": None,
            "weight_versions": [{"version": self.weight_version, "start": 0, "end": 0}] if final else None,
            "logprobs": {"content": content},
        }

    def generate(self, request: dict[str, Any]) -> tuple[str, list[int], Generation, str | None]:
        """Run a generate request; returns its id, prompt, generation and stop reason.

        :raises BadScaleOutRequest: bad ``token_ids`` or ``sampling_params``, or a prompt over the context.
        """
        prompt = request.get("token_ids")
        if not isinstance(prompt, list) or not prompt or not all(type(t) is int and t >= 0 for t in prompt):
            raise BadScaleOutRequest("token_ids must be a non-empty list of non-negative ints")
        self.check_length(prompt)
        params = SamplingParams.from_json(request.get("sampling_params"))
        generation, stop_reason = self.sample(prompt, params)
        request_id = f"generate-tokens-{request.get('request_id') or next(self._ids)}"
        return request_id, prompt, generation, stop_reason

    def response(
        self, request_id: str, model: str, prompt: list[int], generation: Generation, stop_reason: str | None
    ) -> dict[str, Any]:
        """The non-streaming generate answer."""
        choice = self.choice(generation, stop_reason)
        choice["weight_versions"][0]["end"] = len(generation.token_ids)
        count = len(generation.token_ids)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": count, "total_tokens": len(prompt) + count}
        return {
            "request_id": request_id,
            "model": model,
            "created": int(time.time()),
            "usage": usage,
            "prompt_token_ids": None,
            "output_mode": "tokens",
            "choices": [choice],
        }

    def chunks(self, request_id: str, generation: Generation, stop_reason: str | None) -> list[dict[str, Any]]:
        """The streamed generate answer: one chunk per token, the last with the finish and the spans."""
        chunks = []
        count = len(generation.token_ids)
        for index in range(count):
            part = Generation(
                generation.token_ids[index : index + 1],
                generation.logprobs[index : index + 1],
                generation.finish_reason,
            )
            choice = self.choice(part, stop_reason, final=index == count - 1)
            if index == count - 1:
                choice["weight_versions"][0]["end"] = count
            chunks.append({"request_id": request_id, "usage": None, "output_mode": "tokens", "choices": [choice]})
        return chunks
