"""What the engine generated, read from the logging hop (never from the proxy), and the exactness check of a row.

Every generating exchange the hop relayed becomes one :class:`Generated` (prompt ids, generated ids, log-probs):
``/v1/chat/completions`` and ``/v1/completions`` answers with vLLM's token fields (verify mode), and
``/inference/v1/generate`` requests and answers (exact-prefix mode), streamed or not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from sink.trainer.row import LinearizedRow
from tests.helpers.logging_hop import Exchange, LoggingHop

__all__ = ("Generated", "assert_row_is_exact", "generations")


@dataclass(frozen=True)
class Generated:
    """One generation as the engine answered it."""

    prompt: list[int]
    ids: list[int]
    logprobs: list[float]

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.ids


def _choices(exchange: Exchange) -> list[dict[str, Any]]:
    if exchange.response_body.startswith(b"data:"):
        return [event["choices"][0] for event in exchange.events() if event.get("choices")]
    answer = exchange.response_json()
    return [answer["choices"][0]]


def _generated(exchange: Exchange) -> Generated | None:
    if exchange.status != 200 or exchange.method != "POST":
        return None
    if exchange.path == "/inference/v1/generate":
        prompt = exchange.request_json()["token_ids"]
        ids: list[int] = []
        logprobs: list[float] = []
        for choice in _choices(exchange):
            ids += choice["token_ids"]
            logprobs += [entry["logprob"] for entry in choice["logprobs"]["content"]]
        return Generated(prompt, ids, logprobs)
    if exchange.path in ("/v1/chat/completions", "/v1/completions"):
        answer = exchange.response_json()
        choice = answer["choices"][0]
        if choice.get("token_ids") is None:  # no token fields asked: the proxy's start-up probe, not a capture
            return None
        prompt = answer.get("prompt_token_ids") or choice.get("prompt_token_ids")
        if exchange.path == "/v1/chat/completions":
            logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        else:
            logprobs = list(choice["logprobs"]["token_logprobs"])
        return Generated(prompt, choice["token_ids"], logprobs)
    return None


def generations(hop: LoggingHop) -> list[Generated]:
    """Every generation the hop saw, in completion order."""
    return [g for g in (_generated(exchange) for exchange in hop.exchanges) if g is not None]


def assert_row_is_exact(row: LinearizedRow, engine: list[Generated]) -> None:
    """*row* is, token for token, what the engine generated: the last generation's whole sequence, the generated
    ids of its ancestors (each a prefix of the row) masked 1 with the engine's log-probs, every other id masked 0."""
    terminal = next((g for g in reversed(engine) if g.sequence == list(row.token_ids)), None)
    assert terminal is not None, "the row is no sequence the engine generated"
    ancestors = [g for g in engine if list(row.token_ids[: len(g.sequence)]) == g.sequence]
    mask = [0.0] * len(row.token_ids)
    logprobs = [0.0] * len(row.token_ids)
    for generated in ancestors:
        start = len(generated.prompt)
        for offset, value in enumerate(generated.logprobs):
            mask[start + offset] = 1.0
            logprobs[start + offset] = value
    generated_positions = [index for index, flag in enumerate(mask) if flag]
    assert list(row.token_mask) == mask
    assert [row.logprobs[i] for i in generated_positions] == pytest.approx(
        [logprobs[i] for i in generated_positions], rel=1e-6, abs=1e-6
    )
