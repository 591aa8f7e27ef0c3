"""The engines under the scale-out contract: vLLM 0.32's token-in/token-out routes, real or simulated.

:class:`ScaleOutEngine` names what a contract test needs of an engine (its URL, served model, end-of-turn id, the
ids of the generation prompt, how its text decodes) so that one test body runs against both. :func:`post` and
:func:`stream` are plain httpx calls on those routes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from sink_tools.simulated.engine import IM_END, IM_START, ByteTokenizer
from tests.helpers.tls import tls
from tests.helpers.vllm_server import VllmServer

__all__ = ("ScaleOutEngine", "engine_call", "engine_get", "post", "simulated_engine", "stream", "vllm_engine")

_TIMEOUT = httpx.Timeout(120.0)


@dataclass(frozen=True)
class ScaleOutEngine:
    """What the contract tests know of one engine."""

    name: str
    url: str
    model: str
    eot_id: int
    generation_prompt: list[int]
    decode: Callable[[Sequence[int]], str]
    """The message text of generated ids (specials that the engine skips are dropped)."""
    encode: Callable[[str], list[int]]


def simulated_engine(url: str) -> ScaleOutEngine:
    """The simulated engine's description (byte tokenizer, ChatML-like template)."""
    tokenizer = ByteTokenizer()
    prompt = [IM_START, *tokenizer.encode("assistant\n")]
    return ScaleOutEngine("simulated", url, "simulated", IM_END, prompt, tokenizer.decode, tokenizer.encode)


def vllm_engine(server: VllmServer) -> ScaleOutEngine:
    """A real vLLM server's description (the tiny model's vocabulary; ChatML)."""
    names = {index: token for token, index in server.vocab.items()}
    skipped = {server.id_of(token) for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")}

    def decode(ids: Sequence[int]) -> str:
        return "".join(names[token] for token in ids if token not in skipped)

    eot = server.id_of("<|im_end|>")
    prompt = [server.id_of("<|im_start|>"), *server.encode("assistant\n")]
    return ScaleOutEngine(f"vllm-{server.variant}", server.url, server.model, eot, prompt, decode, server.encode)


def post(engine: ScaleOutEngine, path: str, body: dict[str, Any]) -> httpx.Response:
    """POST *body* as JSON to *path* of *engine*."""
    return httpx.post(
        engine.url + path,
        content=orjson.dumps(body),
        timeout=_TIMEOUT,
        headers={"content-type": "application/json"},
        verify=tls(),
    )


def stream(engine: ScaleOutEngine, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST *body* to a streaming route; the ``data:`` events parsed, checking the stream ends with ``[DONE]``."""
    answer = post(engine, path, body)
    assert answer.status_code == 200, answer.text
    lines = [line for line in answer.text.splitlines() if line.startswith("data: ")]
    assert lines and lines[-1] == "data: [DONE]", answer.text[-200:]
    return [orjson.loads(line[len("data: ") :]) for line in lines[:-1]]


def engine_call(client: httpx.AsyncClient, url: str) -> Callable[[str, dict[str, Any]], Awaitable[tuple[int, Any]]]:
    """An :data:`worker.proxy.exact.chat.EngineCall` over *client* to the engine at *url*."""

    async def call(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        answer = await client.post(url + path, content=orjson.dumps(body), headers={"content-type": "application/json"})
        return answer.status_code, orjson.loads(answer.content)

    return call


def engine_get(client: httpx.AsyncClient, url: str) -> Callable[[str], Awaitable[tuple[int, Any]]]:
    """A :data:`worker.proxy.exact.probe.EngineGet` over *client* to the engine at *url*."""

    async def get(path: str) -> tuple[int, Any]:
        answer = await client.get(url + path)
        return answer.status_code, orjson.loads(answer.content) if answer.content else None

    return get
