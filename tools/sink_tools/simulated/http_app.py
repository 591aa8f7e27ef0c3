"""The simulated engine over HTTP, answering like vLLM's OpenAI-compatible server (``staging-sink engine``).

Routes: ``POST /v1/chat/completions`` (streamed or not), ``POST /v1/completions`` (text or token-id prompts),
``POST /v1/responses``, ``POST /tokenize``, ``GET /v1/models``, ``GET /health``. The chat route answers with vLLM
0.32's fields (``tests/test_simulated_vs_vllm.py`` holds it to the shapes recorded from the real server): token
fields null unless asked (``return_token_ids``: top-level ``prompt_token_ids`` and ``choices[i].token_ids``),
log-prob entries ``{token, logprob, bytes, top_logprobs}`` (the end-of-turn's token ``<|im_end|>``;
``return_tokens_as_token_ids``: ``"token_id:<n>"``), ``usage`` counting every generated id, ``system_fingerprint``,
the reasoning and tool-call parsers' message (:mod:`sink_tools.simulated.parsers`; ``finish_reason: "tool_calls"`` for
an auto tool call), ``stop`` strings cut from the text, and the text of a ``stop_token_ids`` id that ended the
generation left out (both kept with ``include_stop_str_in_output``). :class:`EngineOptions` sets the rest: NeMo Gym's
message-level shape, a NeMo RL server's ``required_prefix_token_ids``, ``drift`` (earlier assistant text
re-tokenized differently, so the ``token_in`` check must fire), a reasoning model, generated tool calls and routed
experts (:mod:`sink_tools.simulated.chat_extras`; an end-of-turn ``logit_bias >= 50`` forces an empty reply,
``<= -50`` forbids the end-of-turn), and vLLM 0.32's token-in/token-out routes with ``scale_out``
(:mod:`sink_tools.simulated.scale_out`, :mod:`sink_tools.simulated.derender`; 403 ``PermissionDeniedError`` without it, as
vLLM). ``GET /weight_info`` and ``POST /update_weight_version`` are always served.

The chat route is, as in vLLM, the engine's render of the request (the render route's prompt and sampling
parameters), the generate route's sampling (:meth:`sink_tools.simulated.scale_out.ScaleOut.sample`: the same request gives
the same ids on both routes; greedy decoding and a ``seed`` give the same ids on every call), then the message
assembly (stop string cut, parsers, log-probs, ``usage``). A reply cut by ``max_tokens`` ends cleanly (``<im_end>``
after valid UTF-8; unless the end-of-turn is forbidden or ignored, or a constraint ran out: then
``finish_reason: "length"`` after valid UTF-8), so without drift a re-rendered conversation reproduces the parent's
exact ids. Without ``max_tokens`` the chat route may generate up to the context's end (as vLLM; the simulated model
ends its turn on its own well before); ``/v1/completions`` and ``/v1/responses`` generate up to
``default_max_tokens``.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import anyio
import orjson

from sink_tools.simulated.chat_extras import add_routed_experts, forced_empty, min_tokens_of
from sink_tools.simulated.chat_stream import chat_events, send_events
from sink_tools.simulated.derender import Derender, logprob_entry
from sink_tools.simulated.engine import BYTE_OFFSET, IM_END, IM_START, Generation, SimulatedEngine
from sink_tools.simulated.options import EngineOptions
from sink_tools.simulated.parsers import Parsed, message_of, parse
from sink_tools.simulated.scale_out import (
    FORCED_LOGPROB,
    SCALE_OUT_DISABLED,
    BadScaleOutRequest,
    SamplingParams,
    ScaleOut,
    StopReason,
    forced_id,
    stop_at_token_ids,
    stop_clean,
    top_logprobs,
)
from worker.asgi import Receive, Scope, Send, error_body, read_body, send_body, send_json

__all__ = ("DRIFT_SPACE_ID", "SYSTEM_FINGERPRINT", "EngineApp", "item_text")

DRIFT_SPACE_ID = 3
"""The id a drifting engine gives a space inside earlier assistant text (a "merged" token)."""
_SPACE_ID = BYTE_OFFSET + 0x20
_MODEL = "simulated"
_TOKEN_ID_STRINGS = [f"token_id:{token}" for token in range(BYTE_OFFSET + 256)]
SYSTEM_FINGERPRINT = "vllm-0.32.0-simulated"
"""The chat route's ``system_fingerprint`` (vLLM 0.32: ``vllm-0.32.0-<hash>``)."""


class _BadRequest(Exception):
    pass


class _ScaleOutDisabled(Exception):
    pass


_SCALE_OUT_ROUTES = frozenset(
    {"/v1/chat/completions/render", "/inference/v1/generate", "/v1/chat/completions/derender"}
)


def item_text(item: dict[str, Any]) -> str:
    """The text of a chat message or Responses item (string content, or the texts of its parts)."""
    content = item.get("content", item.get("output", ""))
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise _BadRequest("message content must be a string or a list of parts")


def _cut_stop_string(parsed: Parsed, stop_reason: str) -> Parsed:
    """*parsed* without the stop string at the end of its text (the content, or the reasoning when it ended there)."""
    if parsed.content:
        cut = parsed.content.rfind(stop_reason)
        return Parsed(parsed.reasoning, parsed.content[:cut] if cut >= 0 else parsed.content, [], auto=False)
    if parsed.reasoning:
        cut = parsed.reasoning.rfind(stop_reason)
        return Parsed(parsed.reasoning[:cut] if cut >= 0 else parsed.reasoning, parsed.content, [], auto=False)
    return parsed


class EngineApp:
    """ASGI app: the simulated engine behind an OpenAI-compatible surface (see the module docstring)."""

    def __init__(self, options: EngineOptions | None = None) -> None:
        self.options = options or EngineOptions()
        self.engine = SimulatedEngine(self.options.seed)
        self.scale_out = ScaleOut(
            self.engine, self.options.max_model_len, reasoning=self.options.reasoning_field is not None
        )
        self.derender = Derender(self.options.reasoning_field)
        self._ids = itertools.count(1)
        self.calls = 0

    # --- rendering -----------------------------------------------------------

    def render(self, items: Sequence[Any], *, add_generation_prompt: bool = True) -> list[int]:
        """Chat-template *items* (messages or Responses items) into prompt ids, drift applied."""
        encode = self.engine.tokenizer.encode
        ids: list[int] = []
        for item in items:
            if not isinstance(item, dict):
                raise _BadRequest("every message must be a JSON object")
            role = item.get("role") or item.get("type") or "user"
            text = item_text(item)
            body = encode(f"{role}\n{text}")
            if self.options.drift and role == "assistant":
                body = [DRIFT_SPACE_ID if token == _SPACE_ID else token for token in body]
            ids += [IM_START, *body, IM_END]
        return [*ids, IM_START, *encode("assistant\n")] if add_generation_prompt else ids

    def _prompt(self, request: dict[str, Any], rendered: list[int]) -> list[int]:
        prefix = request.get("required_prefix_token_ids")
        if not (self.options.honour_prefix and prefix):
            return rendered
        if not isinstance(prefix, list) or not all(type(t) is int and t >= 0 for t in prefix):
            raise _BadRequest("required_prefix_token_ids must be a list of non-negative ints")
        return [*prefix, *rendered[len(prefix) :]]

    async def _generate(self, request: dict[str, Any], prompt: list[int]) -> Generation:
        keys = ("max_completion_tokens", "max_tokens", "max_output_tokens")
        max_tokens = next((request[k] for k in keys if request.get(k) is not None), self.options.default_max_tokens)
        min_tokens = request.get("min_tokens") or 0
        if type(max_tokens) is not int or type(min_tokens) is not int or max_tokens < 1 or min_tokens > max_tokens:
            raise _BadRequest(f"need 1 <= max_tokens and min_tokens <= max_tokens, got {min_tokens}..{max_tokens}")
        if request.get("n", 1) != 1:
            raise _BadRequest("the simulated engine serves n == 1 only")
        if self.options.delay_s:
            await anyio.sleep(self.options.delay_s)
        self.calls += 1
        if forced_empty(request):
            return Generation([IM_END], [FORCED_LOGPROB], "stop")
        forced = forced_id(request.get("logit_bias"))
        if forced is not None:  # the model can write nothing else (nor end its turn)
            return Generation([forced] * max_tokens, [FORCED_LOGPROB] * max_tokens, "length")
        min_tokens = min(min_tokens_of(request, min_tokens), max_tokens)
        temperature, seed = request.get("temperature"), request.get("seed")
        temperature = float(temperature) if isinstance(temperature, int | float) else 1.0
        rng = self.engine.call_rng(prompt, temperature=temperature, seed=seed if type(seed) is int else None)
        return stop_clean(self.engine.generate(prompt, max_tokens, min_tokens=min_tokens, rng=rng))

    # --- payloads ----------------------------------------------------------------

    def _token_strings(self, request: dict[str, Any], tokens: list[int]) -> list[str]:
        if request.get("return_tokens_as_token_ids"):
            return [_TOKEN_ID_STRINGS[token] for token in tokens]
        return [self.engine.tokenizer.decode([token]) for token in tokens]

    def _usage(self, prompt: list[int], generation: Generation) -> dict[str, int]:
        completion = len(generation.token_ids)
        return {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion}

    def _gym_fields(self, prompt: list[int], generation: Generation) -> dict[str, Any]:
        return {
            "prompt_token_ids": prompt,
            "generation_token_ids": generation.token_ids,
            "generation_log_probs": generation.logprobs,
        }

    async def _sample(self, prompt: list[int], params: SamplingParams) -> tuple[Generation, StopReason]:
        """The engine's generation, for the generate route and for the chat route after its render."""
        if self.options.delay_s:
            await anyio.sleep(self.options.delay_s)
        self.calls += 1
        return self.scale_out.sample(prompt, params)

    def _chat_logprobs(self, request: dict[str, Any], generation: Generation, count: int) -> dict[str, Any]:
        as_ids = request.get("return_tokens_as_token_ids") is True
        entries = []
        for token, logprob in zip(generation.token_ids, generation.logprobs, strict=True):
            top = [(i, lp) for i, lp, _ in top_logprobs(token, logprob, count)] if count else []
            entries.append(logprob_entry(token, logprob, top, as_ids=as_ids))
        return {"content": entries}

    def chat(
        self,
        request: dict[str, Any],
        prompt: list[int],
        generation: Generation,
        stop_reason: StopReason = None,
        params: SamplingParams | None = None,
    ) -> dict[str, Any]:
        """vLLM 0.32's chat-completion payload (the parsers' message, log-probs with token strings, ``usage``)."""
        options = self.options
        reasoning = options.reasoning_field is not None
        include_stop = request.get("include_stop_str_in_output") is True
        shown = generation.token_ids
        if type(stop_reason) is int and not include_stop:  # the stop token's text is left out, its id and entry kept
            shown = shown[:-1]
        parsed = parse(shown, request, reasoning=reasoning, keep_specials=False)
        if isinstance(stop_reason, str) and not include_stop:
            parsed = _cut_stop_string(parsed, stop_reason)
        message = message_of(parsed, reasoning_field=options.reasoning_field, chat_route=True)
        returned = request.get("return_token_ids") is True
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": "tool_calls" if parsed.auto else generation.finish_reason,
            "stop_reason": stop_reason,
            "token_ids": generation.token_ids if returned else None,
            "routed_experts": None,
        }
        completion = len(generation.token_ids)
        usage: dict[str, Any] = {
            "prompt_tokens": len(prompt),
            "total_tokens": len(prompt) + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
            "completion_tokens_details": {"reasoning_tokens": 0} if reasoning else None,
        }
        payload: dict[str, Any] = {
            "id": f"chatcmpl-{secrets.token_hex(8)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": _MODEL,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage,
            "prompt_logprobs": None,
            "prompt_token_ids": prompt if returned else None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        if options.routed_experts == "message":  # an older engine's shape: the message carries them, not the choice
            del choice["routed_experts"]
        add_routed_experts(payload, prompt, generation, options.routed_experts)
        if options.shape == "nemo-gym":
            message.update(self._gym_fields(prompt, generation))
            return payload
        if request.get("logprobs"):
            choice["logprobs"] = self._chat_logprobs(request, generation, (params.logprobs or 0) if params else 0)
        return payload

    def completion(self, request: dict[str, Any], prompt: list[int], generation: Generation) -> dict[str, Any]:
        """A vLLM text-completion payload (token fields on the choice). ``stop`` strings and ``stop_token_ids`` as
        vLLM: the ids end with the one that completed the string or is the stop id (kept, with its log-prob), the text
        ends before the string or the stop id's text (unless ``include_stop_str_in_output``)."""
        include_stop = request.get("include_stop_str_in_output") is True
        stop_ids = request.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(type(t) is int for t in stop_ids):
            raise _BadRequest("stop_token_ids must be a list of token ids")
        min_tokens = request.get("min_tokens") or 0
        generation, stop_id = stop_at_token_ids(
            generation, stop_ids, min_tokens=min_tokens, ignore_eos=request.get("ignore_eos") is True
        )
        shown = generation.token_ids[:-1] if stop_id is not None and not include_stop else generation.token_ids
        text = self.engine.tokenizer.decode(shown)
        stop_reason: StopReason = stop_id
        stops = request.get("stop") or ()
        for end in range(1, len(shown) + 1) if stops else ():
            text = self.engine.tokenizer.decode(shown[:end])
            hit = next((stop for stop in ([stops] if isinstance(stops, str) else stops) if stop in text), None)
            if hit is not None:
                stop_reason = hit
                generation = Generation(generation.token_ids[:end], generation.logprobs[:end], "stop")
                if not include_stop:
                    text = text[: text.index(hit)]
                break
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": generation.finish_reason,
            "stop_reason": stop_reason,
        }
        if request.get("logprobs") is not None:
            choice["logprobs"] = {
                "tokens": self._token_strings(request, generation.token_ids),
                "token_logprobs": generation.logprobs,
                "top_logprobs": None,
                "text_offset": list(range(len(generation.token_ids))),
            }
        if request.get("return_token_ids"):
            choice["prompt_token_ids"] = prompt
            choice["token_ids"] = generation.token_ids
        return {
            "id": f"cmpl-sim-{next(self._ids)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": _MODEL,
            "choices": [choice],
            "usage": self._usage(prompt, generation),
        }

    def response(self, request: dict[str, Any], prompt: list[int], generation: Generation) -> dict[str, Any]:
        """A Responses-API payload; the message item carries NeMo Gym's fields when ``return_token_ids`` is set."""
        number = next(self._ids)
        text = self.engine.tokenizer.decode(generation.token_ids)
        item: dict[str, Any] = {
            "type": "message",
            "id": f"msg-sim-{number}",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
        if request.get("return_token_ids") or self.options.shape == "nemo-gym":
            item.update(self._gym_fields(prompt, generation))
        completion = len(generation.token_ids)
        return {
            "id": f"resp-sim-{number}",
            "object": "response",
            "created_at": int(time.time()),
            "model": _MODEL,
            "status": "completed",
            "output": [item],
            "parallel_tool_calls": False,
            "tool_choice": "auto",
            "tools": [],
            "usage": {
                "input_tokens": len(prompt),
                "output_tokens": completion,
                "total_tokens": len(prompt) + completion,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
        }

    # --- ASGI -----------------------------------------------------------------

    def _messages(self, request: dict[str, Any]) -> list[int]:
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _BadRequest("messages must be a non-empty list")
        rendered = self.render(messages, add_generation_prompt=request.get("add_generation_prompt", True) is not False)
        self.scale_out.check_length(rendered)
        self.scale_out.check_max_tokens(request)
        return rendered

    async def _scale_out(self, path: str, request: dict[str, Any], send: Send) -> None:
        if not self.options.scale_out:
            raise _ScaleOutDisabled
        if path == "/v1/chat/completions/render":
            rendered = self._messages(request)
            kwargs = request.get("chat_template_kwargs")
            template_kwargs = {
                "add_generation_prompt": request.get("add_generation_prompt", True) is not False,
                "continue_final_message": request.get("continue_final_message") is True,
                **(kwargs if isinstance(kwargs, dict) else {}),
            }
            answer = self.scale_out.render(
                request, rendered, tool_calls=self.options.tool_calls, template_kwargs=template_kwargs
            )
            await send_json(send, 200, answer)
        elif path == "/inference/v1/generate":
            request_id, prompt, params = self.scale_out.generate_request(request)
            generation, stop_reason = await self._sample(prompt, params)
            if not request.get("stream"):
                model = request.get("model") or _MODEL
                answer = self.scale_out.response(request_id, model, prompt, (generation, stop_reason, params))
                await send_json(send, 200, answer)
                return
            chunks = self.scale_out.chunks(request_id, generation, stop_reason, params)
            await send_events(send, chunks)
        elif request.get("stream"):
            await send_json(send, 200, self.derender.chunk(request))
        else:
            await send_json(send, 200, self.derender.chat(request))

    async def _chat_route(self, request: dict[str, Any], send: Send) -> None:
        """vLLM's chat route: the render of the request, the generate route's sampling, then the message assembly."""
        prompt = self._prompt(request, self._messages(request))
        params = self.scale_out.sampling_params(request, prompt, tool_calls=self.options.tool_calls)
        if request.get("n", 1) != 1:
            raise _BadRequest("the simulated engine serves n == 1 only")
        generation, stop_reason = await self._sample(prompt, params)
        payload = self.chat(request, prompt, generation, stop_reason, params)
        if request.get("stream") is not True:
            await send_json(send, 200, payload)
            return
        parse_prefix = partial(
            parse, request=request, reasoning=self.options.reasoning_field is not None, keep_specials=False
        )
        options = request.get("stream_options")
        usage = isinstance(options, dict) and options.get("include_usage") is True
        chunks = chat_events(payload, prompt, generation, parse_prefix, stops=params.stop, include_usage=usage)
        await send_events(send, chunks)

    async def _handle(self, path: str, request: dict[str, Any]) -> dict[str, Any]:
        if path == "/v1/completions":
            raw = request.get("prompt")
            if isinstance(raw, str):
                prompt = self.engine.tokenizer.encode(raw)
            elif isinstance(raw, list) and raw and all(type(t) is int and t >= 0 for t in raw):
                prompt = list(raw)
            else:
                raise _BadRequest("prompt must be a string or a non-empty list of token ids")
            prompt = self._prompt(request, prompt)
            return self.completion(request, prompt, await self._generate(request, prompt))
        if path == "/v1/responses":
            raw_input = request.get("input")
            items = [{"role": "user", "content": raw_input}] if isinstance(raw_input, str) else raw_input
            if not isinstance(items, list) or not items:
                raise _BadRequest("input must be a string or a non-empty list of items")
            prompt = self._prompt(request, self.render(items))
            return self.response(request, prompt, await self._generate(request, prompt))
        if path == "/tokenize":
            if "messages" in request:
                tokens = self.render(request["messages"])
            else:
                tokens = self.engine.tokenizer.encode(str(request.get("prompt", "")))
            return {"tokens": tokens, "count": len(tokens), "max_model_len": 1 << 20}
        raise LookupError(path)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ASGI request (lifespan events are acknowledged)."""
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path == "/health":
            await send_body(send, 200, b"", b"text/plain")
            return
        if method == "GET" and path == "/weight_info":
            await send_json(send, 200, {"weight_version": self.scale_out.weight_version})
            return
        if method == "GET" and path == "/v1/models":
            models = {"object": "list", "data": [{"id": _MODEL, "object": "model", "created": 0, "owned_by": "sim"}]}
            await send_json(send, 200, models)
            return
        if method != "POST":
            await send_body(send, 404, error_body(404, f"no route {method} {path}", "NotFoundError"))
            return
        try:
            request = orjson.loads(await read_body(receive))
            if not isinstance(request, dict):
                raise _BadRequest("the request body must be a JSON object")
            if path in _SCALE_OUT_ROUTES:
                await self._scale_out(path, request, send)
                return
            if path == "/v1/chat/completions":
                await self._chat_route(request, send)
                return
            if path == "/update_weight_version":
                version = request.get("new_version")
                if not isinstance(version, str):
                    raise _BadRequest("new_version must be a string")
                self.scale_out.weight_version = version
                await send_json(send, 200, {"success": True, "new_version": version})
                return
            payload = await self._handle(path, request)
        except _ScaleOutDisabled:
            await send_body(send, 403, error_body(403, SCALE_OUT_DISABLED, "PermissionDeniedError"))
            return
        except BadScaleOutRequest as exc:
            error = {"message": str(exc), "type": "BadRequestError", "param": exc.param, "code": 400}
            await send_json(send, 400, {"error": error})
            return
        except (_BadRequest, orjson.JSONDecodeError, ValueError) as exc:
            await send_body(send, 400, error_body(400, str(exc), "BadRequestError"))
            return
        except LookupError:
            await send_body(send, 404, error_body(404, f"no route {method} {path}", "NotFoundError"))
            return
        await send_json(send, 200, payload)
