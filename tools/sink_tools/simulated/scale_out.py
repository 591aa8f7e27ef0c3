"""vLLM 0.32's token-in/token-out routes on the simulated engine, with the shapes the real server answers.

``/v1/chat/completions/render`` (a chat request to a generate request: templated ``token_ids`` plus
``sampling_params``), ``/inference/v1/generate`` (from ``token_ids``, streaming or not: per choice ``token_ids``,
log-probs with integer ids, ``finish_reason``, ``stop_reason``, ``weight_versions`` spans) and
``/v1/chat/completions/derender`` (:mod:`sink_tools.simulated.derender`), plus ``GET /weight_info`` and
``POST /update_weight_version``. ``tests/test_simulated_vs_vllm.py`` holds every answer to the shapes recorded from
the real vLLM 0.32, including what vLLM leaves out:

* render serializes ``sampling_params`` as vLLM does (``msgspec`` with ``omit_defaults``): an integer, boolean or
  ``None`` field equal to its ``SamplingParams`` default is **omitted** (``max_tokens: 16``, ``min_tokens: 0``,
  ``top_k: 0``, ``seed: null``, ``ignore_eos: false``, ``logprobs: null``, ...), the float fields are always written
  (``top_p``, ``top_k`` and ``min_p`` vanish under greedy decoding), and a request without ``max_tokens`` gets
  ``max_model_len - len(prompt)``;
* generate without ``max_tokens`` fills the context (so ``max_tokens: 16`` lost between render and generate makes a
  generation up to the context length: the quirk a proxy must work around);
* log-probs only when ``sampling_params.logprobs`` is set; each entry's ``top_logprobs`` holds ``max(logprobs, 1)``
  entries, the sampled token's first.

Sampling (:meth:`ScaleOut.sample`) is the engine's one generation: the generate route runs it on the request's
``sampling_params``, and the chat route is render then the same sampling then the parsers, as in vLLM (so the same
request gives the same ids on both routes). It honours ``max_tokens`` (capped to the context), ``min_tokens``,
``stop`` strings (the ids keep the token that completed the string), ``stop_token_ids`` (:func:`stop_at_token_ids`),
``ignore_eos`` (end-of-turn ids stay inside the output), a ``logit_bias`` on the end-of-turn id (``>= 50`` forces it,
``<= -50`` forbids it) or on another id (``>= 50`` forces it at every position: :func:`forced_id`), ``structured_outputs``
(:mod:`sink_tools.simulated.structured`) and, on a reasoning engine, the ``</think>`` marker
(:func:`sink_tools.simulated.parsers.think`). The simulated model ends its turn on its last allowed id (``<im_end>``
after valid UTF-8, ``finish_reason: "stop"``) unless the end-of-turn is ignored or forbidden or a constraint runs
out (``length``, after valid UTF-8), so a re-rendered conversation reproduces a reply's ids. As vLLM, greedy
decoding (``temperature`` 0) and a request ``seed`` are deterministic: the same prompt and parameters give the same
ids every time (:meth:`sink_tools.simulated.engine.SimulatedEngine.call_rng`); unseeded sampling draws anew.
"""

from __future__ import annotations

import random
import secrets
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sink_tools.simulated.engine import (
    BYTE_OFFSET,
    GREEDY_TEMPERATURE,
    IM_END,
    FinishReason,
    Generation,
    SimulatedEngine,
)
from sink_tools.simulated.parsers import THINK_END, think
from sink_tools.simulated.structured import BadStructuredRequest, constraint_of_chat, forced_text

__all__ = (
    "FORCED_LOGPROB",
    "SCALE_OUT_DISABLED",
    "BadScaleOutRequest",
    "SamplingParams",
    "ScaleOut",
    "StopReason",
    "forced_id",
    "stop_at_token_ids",
    "stop_clean",
    "top_logprobs",
)

SCALE_OUT_DISABLED = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
_FORCE_BIAS = 50.0
_NATURAL_LENGTH = 64
"""At most this many ids per free draw: a generation asked for the whole context still ends on its own, like a model."""
_VLLM_DEFAULT_MAX_TOKENS = 16
_SPACE_ID = BYTE_OFFSET + 0x20
FORCED_LOGPROB = -0.015625
"""The log-prob of every id a ``logit_bias`` forces (binary32-exact)."""
StopReason = str | int | None
"""A generation's ``stop_reason``: the stop string, the stop token id, or ``None`` (end-of-turn or length)."""


class BadScaleOutRequest(ValueError):
    """A request the real engine answers with 400 ``BadRequestError`` (``param``: the field at fault, as vLLM)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _numbers(raw: dict[str, Any]) -> dict[str, float]:
    """The float sampling fields *raw* sets (``temperature``, ``top_p``, ``min_p``, the penalties)."""
    keys = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
    return {key: float(raw[key]) for key in keys if isinstance(raw.get(key), int | float)}


def _floats(raw: Any) -> dict[str, float]:
    if not isinstance(raw, dict):
        return {}
    return {str(key): float(value) for key, value in raw.items() if isinstance(value, int | float)}


@dataclass(frozen=True)
class SamplingParams:
    """The sampling parameters of a generate request, with vLLM's defaults (``max_tokens=None``: fill the context)."""

    max_tokens: int | None = _VLLM_DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    logprobs: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] = field(default_factory=dict)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured: dict[str, Any] | None = None
    stream: bool = False

    @property
    def eot_bias(self) -> float:
        """The ``logit_bias`` on the end-of-turn id."""
        return self.logit_bias.get(str(IM_END), 0.0)

    def to_json(self) -> dict[str, Any]:
        """The ``sampling_params`` object as vLLM 0.32 serializes it (see the module docstring)."""
        greedy = self.temperature < GREEDY_TEMPERATURE
        out: dict[str, Any] = {
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "temperature": self.temperature,
        }
        if not greedy:
            out["top_p"] = self.top_p
            if self.top_k != 0:
                out["top_k"] = self.top_k
            out["min_p"] = self.min_p
        if self.seed is not None:
            out["seed"] = self.seed
        out["stop"], out["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        optional = {
            "ignore_eos": (self.ignore_eos, False),
            "max_tokens": (self.max_tokens, _VLLM_DEFAULT_MAX_TOKENS),
            "min_tokens": (self.min_tokens, 0),
            "logprobs": (self.logprobs, None),
            "include_stop_str_in_output": (self.include_stop_str_in_output, False),
        }
        out.update({key: value for key, (value, default) in optional.items() if value != default})
        if self.stop and not self.include_stop_str_in_output and max(len(s) for s in self.stop) > 1:
            out["output_text_buffer_length"] = max(len(s) for s in self.stop) - 1
        out["output_kind"] = 1 if self.stream else 2
        out["skip_clone"] = True
        if self.structured is not None:
            out["structured_outputs"] = self.structured
        if self.logit_bias:
            out["logit_bias"] = dict(self.logit_bias)
        out["bad_words"], out["skip_reading_prefix_cache"] = [], False
        return out

    @classmethod
    def from_json(cls, raw: Any) -> SamplingParams:
        """Parse a generate request's ``sampling_params`` (an absent ``max_tokens`` stays ``None``: fill the context).

        :raises BadScaleOutRequest: not an object, or bad counts or stop strings.
        """
        if not isinstance(raw, dict):
            raise BadScaleOutRequest("sampling_params must be an object")
        stop = raw.get("stop") or ()
        structured = raw.get("structured_outputs")
        top_k, seed = raw.get("top_k"), raw.get("seed")
        params = cls(
            max_tokens=raw.get("max_tokens"),
            min_tokens=raw.get("min_tokens") or 0,
            logprobs=raw.get("logprobs"),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(raw.get("stop_token_ids") or ()),
            ignore_eos=bool(raw.get("ignore_eos")),
            include_stop_str_in_output=bool(raw.get("include_stop_str_in_output")),
            logit_bias=_floats(raw.get("logit_bias")),
            structured=structured if isinstance(structured, dict) else None,
            stream=raw.get("output_kind") == 1,
            top_k=top_k if type(top_k) is int else 0,
            seed=seed if type(seed) is int else None,
            **_numbers(raw),
        )
        params.check()
        return params

    @classmethod
    def of_chat(cls, request: dict[str, Any], max_tokens: int, *, tool_calls: bool = False) -> SamplingParams:
        """The sampling parameters of a chat-completions request (*max_tokens* when it names none).

        :raises BadScaleOutRequest: what vLLM refuses (``top_logprobs`` without ``logprobs``, bad counts).
        """
        keys = ("max_completion_tokens", "max_tokens")
        top = request.get("top_logprobs")
        if top and not request.get("logprobs"):
            raise BadScaleOutRequest(
                "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)", "top_logprobs"
            )
        stop = request.get("stop") or ()
        try:
            structured = constraint_of_chat(request, tool_calls=tool_calls)
        except BadStructuredRequest as exc:
            raise BadScaleOutRequest(str(exc)) from exc
        top_k, seed = request.get("top_k"), request.get("seed")
        params = cls(
            max_tokens=next((request[k] for k in keys if request.get(k) is not None), max_tokens),
            min_tokens=request.get("min_tokens") or 0,
            logprobs=(top or 0) if request.get("logprobs") else None,
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(request.get("stop_token_ids") or ()),
            ignore_eos=request.get("ignore_eos") is True,
            include_stop_str_in_output=request.get("include_stop_str_in_output") is True,
            logit_bias=_floats(request.get("logit_bias")),
            top_k=top_k if isinstance(top_k, int) else 0,
            seed=seed if isinstance(seed, int) else None,
            structured=structured,
            stream=request.get("stream") is True,
            **_numbers(request),
        )
        params.check()
        return params

    def check(self) -> None:
        """:raises BadScaleOutRequest: counts out of range, or stop strings that are not non-empty strings."""
        limit = self.max_tokens
        bad_max = limit is not None and (type(limit) is not int or limit < 1)
        if bad_max or type(self.min_tokens) is not int or (limit is not None and self.min_tokens > limit):
            raise BadScaleOutRequest(
                f"need 1 <= max_tokens and min_tokens <= max_tokens, got {self.min_tokens}..{limit}",
                "max_tokens" if bad_max else "min_tokens",
            )
        if not all(isinstance(s, str) and s for s in self.stop):
            raise BadScaleOutRequest("stop must be a string or a list of non-empty strings", "stop")


def _valid_tail(ids: list[int]) -> list[int]:
    """*ids* with the bytes of a character cut off at their end replaced by spaces (same length)."""
    start = len(ids)
    while start > 0 and ids[start - 1] >= BYTE_OFFSET and len(ids) - start < 4:
        start -= 1
    tail = bytes(token - BYTE_OFFSET for token in ids[start:])
    valid = tail.decode("utf-8", errors="ignore").encode("utf-8")
    if tail.startswith(valid) and len(valid) < len(tail):
        return [*ids[:start], *(BYTE_OFFSET + byte for byte in valid), *[_SPACE_ID] * (len(tail) - len(valid))]
    return ids


def stop_clean(generation: Generation) -> Generation:
    """*generation* ending with ``<im_end>`` after valid UTF-8 (same length and log-probs)."""
    if generation.finish_reason == "stop":
        return generation
    ids = [*_valid_tail(generation.token_ids[:-1]), IM_END]
    return Generation(ids, generation.logprobs, "stop")


def forced_id(logit_bias: Any) -> int | None:
    """The id a ``logit_bias >= 50`` forces at every position (the largest such bias), or ``None``."""
    forced = [(bias, int(key)) for key, bias in _floats(logit_bias).items() if bias >= _FORCE_BIAS and key.isdigit()]
    return max(forced)[1] if forced else None


def stop_at_token_ids(
    generation: Generation, stop_token_ids: Sequence[int], *, min_tokens: int, ignore_eos: bool
) -> tuple[Generation, int | None]:
    """*generation* under ``stop_token_ids``, as vLLM 0.32: and the stop id it ended on (``None``: none did).

    Before *min_tokens* ids the stop ids cannot be sampled (there the simulated model writes the first printable
    byte that is not one); the generation ends on the first stop id after that, ``finish_reason: "stop"``, the id
    and its log-prob kept. The end-of-turn id stops with ``stop_reason`` ``None`` as always, so it counts as a stop
    token id only under ``ignore_eos``. Log-probs are left as they were.
    """
    stops = set(stop_token_ids)
    if not stops:
        return generation, None
    filler = next(token for token in range(_SPACE_ID, BYTE_OFFSET + 0x7F) if token not in stops)
    ids = [filler if token in stops and index < min_tokens else token for index, token in enumerate(generation.token_ids)]
    if not ignore_eos:
        stops.discard(IM_END)
    end = next((index for index, token in enumerate(ids) if token in stops), None)
    if end is None:
        return Generation(ids, generation.logprobs, generation.finish_reason), None
    return Generation(ids[: end + 1], generation.logprobs[: end + 1], "stop"), ids[end]


def top_logprobs(token: int, logprob: float, count: int) -> list[tuple[int, float, int]]:
    """``(id, log-prob, rank)`` of a position's top log-probs: the sampled token first, then made-up runners-up
    (float32 values, as vLLM's)."""
    if count < 2:
        return [(token, logprob, 1)]
    values = array("f", [logprob - 0.25 * rank for rank in range(2, count + 1)])
    others = [(BYTE_OFFSET + 0x20 + rank, value, rank) for rank, value in enumerate(values, start=2)]
    return [(token, logprob, 1), *others]


class ScaleOut:
    """The routes' logic over one :class:`SimulatedEngine` (the HTTP app dispatches to it)."""

    def __init__(self, engine: SimulatedEngine, max_model_len: int, *, reasoning: bool = False) -> None:
        self.engine = engine
        self.max_model_len = max_model_len
        self.reasoning = reasoning
        self.weight_version = "default"

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
                    "Please request fewer output tokens.",
                    "max_tokens",
                )

    def sampling_params(self, request: dict[str, Any], token_ids: Sequence[int], *, tool_calls: bool) -> SamplingParams:
        """The sampling parameters render gives a chat request whose template rendered *token_ids* (the chat route
        samples with them too): ``max_tokens`` capped to the context, and filling it when the request names none.

        :raises BadScaleOutRequest: a prompt over the context, or what :meth:`SamplingParams.of_chat` refuses.
        """
        self.check_length(token_ids)
        self.check_max_tokens(request)
        room = self.max_model_len - len(token_ids)
        params = SamplingParams.of_chat(request, room, tool_calls=tool_calls)
        return params if params.max_tokens is None or params.max_tokens <= room else replace(params, max_tokens=room)

    def render(
        self, request: dict[str, Any], token_ids: list[int], *, tool_calls: bool, template_kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """The generate request of a chat request whose template rendered *token_ids* (vLLM 0.32's fields)."""
        params = self.sampling_params(request, token_ids, tool_calls=tool_calls)
        options = request.get("stream_options")
        if isinstance(options, dict):
            options = {"include_usage": options.get("include_usage"), "continuous_usage_stats": False, **options}
        return {
            "request_id": f"chatcmpl-{secrets.token_hex(8)}",
            "token_ids": token_ids,
            "token_offsets": None,
            "features": None,
            "content_parts": None,
            "sampling_params": params.to_json(),
            "model": request.get("model") or "simulated",
            "reasoning_ended": False if self.reasoning else None,
            "reasoning_parser_kwargs": {"chat_template_kwargs": template_kwargs} if self.reasoning else None,
            "return_token_ids": request.get("return_token_ids"),
            "output_mode": "tokens",
            "stream": request.get("stream") is True,
            "stream_options": options,
            "cache_salt": None,
            "priority": 0,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
        }

    def _forced(self, text: str, limit: int, rng: random.Random | None) -> Generation:
        """A constrained generation: (on a reasoning engine, free reasoning and ``</think>``, then) *text* and the
        end-of-turn, the forced ids at log-prob 0.0; cut at *limit* ids (``length``)."""
        head: list[int] = []
        head_logprobs: list[float] = []
        forced = self.engine.tokenizer.encode(text)
        if self.reasoning:  # a short reasoning (at least one character), leaving room for the forced text if it can
            room = max(2, min(limit - len(forced) - 2, _NATURAL_LENGTH))
            part = self.engine.generate((), room, min_tokens=2, rng=rng)
            body = part.token_ids[:-1] if part.token_ids[-1] == IM_END else part.token_ids
            head, head_logprobs = [*body, THINK_END], [*part.logprobs[: len(body)], -0.5]
        ids = [*head, *forced, IM_END]
        logprobs = [*head_logprobs, *[0.0] * (len(ids) - len(head))]
        finish: FinishReason = "length" if len(ids) > limit else "stop"
        return Generation(ids[:limit], logprobs[:limit], finish)

    def _free(self, params: SamplingParams, limit: int, rng: random.Random | None) -> Generation:
        forced = forced_id(params.logit_bias)
        if forced == IM_END:
            count = limit if params.ignore_eos else 1
            return Generation([IM_END] * count, [FORCED_LOGPROB] * count, "length" if params.ignore_eos else "stop")
        if forced is not None:  # the model can write nothing else (nor end its turn)
            return Generation([forced] * limit, [FORCED_LOGPROB] * limit, "length")
        ids: list[int] = []
        logprobs: list[float] = []
        while len(ids) < limit:
            floor = max(params.min_tokens - len(ids), 1)
            draw = min(limit - len(ids), max(_NATURAL_LENGTH, floor))
            part = self.engine.generate(ids, draw, min_tokens=floor, rng=rng)
            body = part.token_ids
            if params.eot_bias <= -_FORCE_BIAS and body[-1] == IM_END:
                body = [*body[:-1], BYTE_OFFSET + 0x20]
            ids += body
            logprobs += part.logprobs
            if body[-1] == IM_END and not params.ignore_eos:
                break
        finish: FinishReason = "stop" if ids[-1] == IM_END and not params.ignore_eos else "length"
        generation = Generation(ids, logprobs, finish)
        return think(generation, params.logit_bias) if self.reasoning else generation

    def sample(self, prompt: Sequence[int], params: SamplingParams) -> tuple[Generation, StopReason]:
        """The engine's generation after *prompt* under *params* (the generate route's, and the chat route's after
        its render); returns it and its ``stop_reason`` (the stop string or stop token id, if any). See the module
        docstring.

        ``max_tokens`` absent or over the context: up to the context's end (``max_model_len - len(prompt)``), as
        vLLM's generate route. Greedy decoding or a ``seed``: the call's own generator, derived from the prompt.
        """
        room = self.max_model_len - len(prompt)
        limit = room if params.max_tokens is None else min(params.max_tokens, room)
        rng = self.engine.call_rng(prompt, temperature=params.temperature, seed=params.seed)
        text = forced_text(params.structured)
        generation = self._free(params, limit, rng) if text is None else self._forced(text, limit, rng)
        generation, stop_id = stop_at_token_ids(
            generation, params.stop_token_ids, min_tokens=params.min_tokens, ignore_eos=params.ignore_eos
        )
        # A stop id's own text is not searched for stop strings unless the output includes it (vLLM's detokenizer).
        hidden = 1 if stop_id is not None and not params.include_stop_str_in_output else 0
        generation, stop_string = self._stop_string(generation, params.stop, hidden=hidden)
        stop_reason: StopReason = stop_string if stop_string is not None else stop_id
        if generation.finish_reason == "length" and stop_reason is None:
            unending = params.ignore_eos or params.eot_bias <= -_FORCE_BIAS or forced_id(params.logit_bias) is not None
            if unending or params.structured is not None:
                generation = Generation(_valid_tail(generation.token_ids), generation.logprobs, "length")
            else:  # the model ends its turn on its last allowed id
                generation = stop_clean(generation)
        return generation, stop_reason

    def _stop_string(
        self, generation: Generation, stops: tuple[str, ...], *, hidden: int = 0
    ) -> tuple[Generation, str | None]:
        """*generation* cut after the id that completes the first of *stops* in its text (the last *hidden* ids'
        text left out), and that stop string."""
        ids = generation.token_ids
        for end in range(1, len(ids) + 1 - hidden) if stops else ():  # none: no per-prefix decode (quadratic)
            decoded = self.engine.tokenizer.decode(ids[:end])
            hit = next((stop for stop in stops if stop in decoded), None)
            if hit is not None:
                return Generation(ids[:end], generation.logprobs[:end], "stop"), hit
        return generation, None

    def choice(
        self, generation: Generation, stop_reason: StopReason, params: SamplingParams, *, final: bool = True
    ) -> dict[str, Any]:
        """A generate choice carrying *generation*'s ids (``weight_versions`` on the final one only)."""
        logprobs = None
        if params.logprobs is not None:
            count = max(params.logprobs, 1)
            content = [
                {
                    "token_id": token,
                    "logprob": logprob,
                    "rank": 1,
                    "top_logprobs": [
                        {"token_id": i, "logprob": lp, "rank": r} for i, lp, r in top_logprobs(token, logprob, count)
                    ],
                }
                for token, logprob in zip(generation.token_ids, generation.logprobs, strict=True)
            ]
            logprobs = {"content": content}
        return {
            "index": 0,
            "finish_reason": generation.finish_reason if final else None,
            "stop_reason": stop_reason if final else None,
            "token_ids": generation.token_ids,
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": [{"version": self.weight_version, "start": 0, "end": 0}] if final else None,
            "logprobs": logprobs,
        }

    def generate_request(self, request: dict[str, Any]) -> tuple[str, list[int], SamplingParams]:
        """A generate request's id, prompt and sampling parameters (:meth:`sample` runs it; a ``max_tokens`` over
        the context is capped to it, silently, as vLLM).

        :raises BadScaleOutRequest: bad ``token_ids`` or ``sampling_params``, or a prompt over the context.
        """
        prompt = request.get("token_ids")
        if not isinstance(prompt, list) or not prompt or not all(type(t) is int and t >= 0 for t in prompt):
            raise BadScaleOutRequest("token_ids must be a non-empty list of non-negative ints")
        self.check_length(prompt)
        params = SamplingParams.from_json(request.get("sampling_params"))
        request_id = f"generate-tokens-{request.get('request_id') or secrets.token_hex(8)}"
        return request_id, prompt, params

    def response(
        self,
        request_id: str,
        model: str,
        prompt: list[int],
        generated: tuple[Generation, StopReason, SamplingParams],
    ) -> dict[str, Any]:
        """The non-streaming generate answer."""
        generation, stop_reason, params = generated
        choice = self.choice(generation, stop_reason, params)
        choice["weight_versions"][0]["end"] = len(generation.token_ids)
        count = len(generation.token_ids)
        usage = {
            "prompt_tokens": len(prompt),
            "total_tokens": len(prompt) + count,
            "completion_tokens": count,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }
        empty = ("prompt_logprobs", "prompt_token_id_logprobs", "prompt_token_ids", "mm_placeholders", "metrics")
        return {
            "request_id": request_id,
            "model": model,
            "created": int(time.time()),
            "usage": usage,
            **dict.fromkeys(empty),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "output_mode": "tokens",
            "choices": [choice],
        }

    def chunks(
        self, request_id: str, generation: Generation, stop_reason: StopReason, params: SamplingParams
    ) -> list[dict[str, Any]]:
        """The streamed generate answer: one chunk per token, the last with the finish and the spans."""
        chunks = []
        count = len(generation.token_ids)
        for index in range(count):
            part = Generation(
                generation.token_ids[index : index + 1],
                generation.logprobs[index : index + 1],
                generation.finish_reason,
            )
            choice = self.choice(part, stop_reason, params, final=index == count - 1)
            if index == count - 1:
                choice["weight_versions"][0]["end"] = count
            chunks.append({"request_id": request_id, "usage": None, "output_mode": "tokens", "choices": [choice]})
        return chunks
