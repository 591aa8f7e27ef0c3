"""A deterministic simulated inference engine and agent-rollout driver.

For tests, the demo and benchmarks: no model, no sleeps, no network. The
tokenizer is byte-level (one id per UTF-8 byte, plus a few specials), so
decoding a generation cut inside a multi-byte character yields U+FFFD exactly
as a real BPE detokenizer does. The generator is seeded: one seed and one
sequence of calls give the same ids and log-probs every run; a call given its
own generator (:meth:`SimulatedEngine.call_rng`: greedy decoding or a request
seed, as vLLM makes those deterministic) gives the same ids whatever ran before.

The driver, :func:`simulate_rollout`, plays both the gate (admissions built
from committed coordinates, inline or by ``staging_chain``) and the serving
host (prefix entry, generation, capture completion) for a multi-turn agent
rollout with tool turns, retries, abandoned branches and injected failures.
"""

from __future__ import annotations

import hashlib
import random
import threading
from array import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from sink.contract.records import CaptureAdmission, CommitCoords
from worker.capture import RolloutTokenCapture
from worker.prefix import resolve_prefix

__all__ = (
    "BYTE_OFFSET",
    "GREEDY_TEMPERATURE",
    "IM_END",
    "IM_START",
    "ByteTokenizer",
    "CallTrace",
    "Generation",
    "RolloutTrace",
    "SimulatedEngine",
    "simulate_rollout",
)

IM_START = 1
IM_END = 2
BYTE_OFFSET = 16
"""Token id of UTF-8 byte ``b`` is ``BYTE_OFFSET + b``; ids below are specials."""
GREEDY_TEMPERATURE = 1e-5
"""Decoding below this temperature is greedy (vLLM's ``_SAMPLING_EPS``)."""

_VOCAB_SIZE = BYTE_OFFSET + 256
# Mostly ASCII, with 2-, 3- and 4-byte characters so that length cuts can
# split a character.
_ALPHABET = tuple("abcdefghijklmnopqrstuvwxyz      .,") + ("é", "ß", "→", "€", "🙂")
_WEIGHTS = (10,) * 26 + (30,) * 6 + (5, 5) + (2, 2, 1, 1, 1)
FinishReason = Literal["stop", "length"]


class ByteTokenizer:
    """Byte-level toy tokenizer with a ChatML-like template."""

    def encode(self, text: str) -> list[int]:
        """Ids of the UTF-8 bytes of *text*."""
        return [BYTE_OFFSET + byte for byte in text.encode("utf-8")]

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of *token_ids*; specials are dropped, invalid UTF-8 becomes U+FFFD.

        :raises ValueError: an id outside the vocabulary.
        """
        if token_ids and not (0 <= min(token_ids) and max(token_ids) < _VOCAB_SIZE):
            raise ValueError("token id outside the simulated vocabulary")
        raw = bytes([token - BYTE_OFFSET for token in token_ids if token >= BYTE_OFFSET])
        return raw.decode("utf-8", errors="replace")

    def render_chat(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        """``<im_start>role\\ncontent<im_end>`` per message, then the assistant header."""
        ids: list[int] = []
        for message in messages:
            ids.append(IM_START)
            ids += self.encode(f"{message['role']}\n{message['content']}")
            ids.append(IM_END)
        if add_generation_prompt:
            ids.append(IM_START)
            ids += self.encode("assistant\n")
        return ids


@dataclass(frozen=True)
class Generation:
    """One engine generation: ids, their behaviour log-probs and the finish reason."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


class SimulatedEngine:
    """Seeded generator of ids and finite negative log-probs (float32 values, as vLLM's).

    Thread-safe; deterministic for a given seed and call order (the shared
    generator), and per call for a call drawing from its own (:meth:`call_rng`).
    """

    def __init__(self, seed: int = 0, *, tokenizer: ByteTokenizer | None = None) -> None:
        self.tokenizer = tokenizer or ByteTokenizer()
        self.seed = seed
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._responses = 0

    def call_rng(
        self, prompt_token_ids: Sequence[int], *, temperature: float, seed: int | None
    ) -> random.Random | None:
        """The generator of one request, or ``None`` for the shared one.

        As vLLM, greedy decoding (*temperature* below :data:`GREEDY_TEMPERATURE`)
        and a request *seed* are deterministic: such a request gets its own
        generator, derived from the engine's seed, ``greedy`` (which wins over a
        seed) or the request's seed, and the prompt ids, so the same request
        generates the same ids every time, whatever ran before. Unseeded sampling
        draws from the shared generator (``None``).
        """
        greedy = temperature < GREEDY_TEMPERATURE
        if not greedy and seed is None:
            return None
        key = f"{self.seed}/{'greedy' if greedy else f'seed {seed}'}/{','.join(map(str, prompt_token_ids))}"
        return random.Random(hashlib.blake2b(key.encode(), digest_size=16).digest())

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        min_tokens: int = 0,
        rng: random.Random | None = None,
    ) -> Generation:
        """Generate between ``max(min_tokens, 1)`` and *max_tokens* tokens after the prompt.

        A ``stop`` generation ends with ``IM_END``; a ``length`` one stops at
        *max_tokens* and may end inside a multi-byte character. *rng*: the
        call's own generator (:meth:`call_rng`); the shared one when ``None``.

        :raises ValueError: ``max_tokens < 1`` or ``min_tokens > max_tokens``.
        """
        if max_tokens < 1 or min_tokens > max_tokens:
            raise ValueError(f"need 1 <= max_tokens and min_tokens <= max_tokens, got {min_tokens}..{max_tokens}")
        if rng is not None:
            return _draw(rng, max_tokens, min_tokens)
        with self._lock:
            return _draw(self._rng, max_tokens, min_tokens)

    def chat_response(
        self, prompt_token_ids: Sequence[int], generation: Generation, *, routed_experts: bool = False
    ) -> dict[str, Any]:
        """A vLLM OpenAI chat-completion payload (``return_tokens_as_token_ids`` style)."""
        with self._lock:
            self._responses += 1
            number = self._responses
        message: dict[str, Any] = {"role": "assistant", "content": self.tokenizer.decode(generation.token_ids)}
        if routed_experts:
            message["routed_experts"] = [[[token % 8, (token * 7) % 8]] for token in generation.token_ids]
        content = [
            {"token": f"token_id:{token}", "logprob": logprob}
            for token, logprob in zip(generation.token_ids, generation.logprobs, strict=True)
        ]
        return {
            "id": f"chatcmpl-sim-{number}",
            "object": "chat.completion",
            "model": "simulated",
            "prompt_token_ids": list(prompt_token_ids),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": {"content": content},
                    "finish_reason": generation.finish_reason,
                }
            ],
        }

    def megatron_response(self, prompt_token_ids: Sequence[int], generation: Generation) -> dict[str, Any]:
        """A Megatron-style payload (``prompt_tokens``, ``generated_tokens``, ``generated_log_probs``)."""
        return {
            "prompt_tokens": list(prompt_token_ids),
            "generated_tokens": list(generation.token_ids),
            "generated_log_probs": list(generation.logprobs),
        }


def _draw(rng: random.Random, max_tokens: int, min_tokens: int) -> Generation:
    count = rng.randint(max(min_tokens, 1), max_tokens)
    stop = count < max_tokens or rng.random() < 0.5
    text = "".join(rng.choices(_ALPHABET, _WEIGHTS, k=count)).encode("utf-8")
    if stop:
        text = text[: count - 1].decode("utf-8", errors="ignore").encode("utf-8")
        text = text + b" " * (count - 1 - len(text))  # keep the exact length
        ids = [BYTE_OFFSET + byte for byte in text] + [IM_END]
    else:
        ids = [BYTE_OFFSET + byte for byte in text[:count]]
    # float32 values, as vLLM reports them (it computes log-probs in float32: tests/test_engine_scale_out.py)
    logprobs = array("f", [-(rng.random() * 4.0 + 1e-3) for _ in ids]).tolist()
    return Generation(ids, logprobs, "stop" if stop else "length")


CallRole = Literal["main", "retried", "branch"]


@dataclass
class CallTrace:
    """One model call of a simulated rollout, as the gate and the host saw it.

    ``role``: ``main`` (on the terminal's path), ``retried`` (an attempt the
    client re-issued: a childless sibling) or ``branch`` (an abandoned side
    branch). ``admission``/``coords`` are ``None`` for calls served uncaptured.
    """

    model_call_id: str
    role: CallRole
    admission: CaptureAdmission | None
    coords: CommitCoords | None
    prompt_token_ids: list[int]
    generation: Generation
    request_items: list[dict[str, Any]]
    response_items: list[dict[str, Any]]
    staging_chain: tuple[str, ...] = ()

    @property
    def staged(self) -> bool:
        """Whether the call's delta was staged (it can be a parent)."""
        return self.coords is not None and self.coords.disposition == "staged"

    @property
    def full_token_ids(self) -> list[int]:
        """The engine's full sequence: prompt then generated ids."""
        return self.prompt_token_ids + self.generation.token_ids


@dataclass
class RolloutTrace:
    """All calls of a simulated rollout in issue order, and its terminal call."""

    rollout_id: str
    calls: list[CallTrace] = field(default_factory=list)
    terminal_model_call_id: str | None = None

    @property
    def staged_calls(self) -> list[CallTrace]:
        """Calls whose coords are ``staged``."""
        return [call for call in self.calls if call.staged]

    @property
    def failed_calls(self) -> list[CallTrace]:
        """Calls acknowledged with ``capture_failed`` coords."""
        return [call for call in self.calls if call.coords is not None and not call.staged]

    def call(self, model_call_id: str) -> CallTrace:
        """The trace of *model_call_id*.

        :raises KeyError: unknown id.
        """
        for call in self.calls:
            if call.model_call_id == model_call_id:
                return call
        raise KeyError(model_call_id)


@dataclass
class _Driver:
    capture: RolloutTokenCapture
    engine: SimulatedEngine
    rollout_id: str
    max_tokens: int
    min_tokens: int
    prefix_mode: Literal["inline", "chain"]
    use_adapter: bool
    prefix_source: Any
    trace: RolloutTrace

    def observation(self, turn: int, branch: int | None = None) -> dict[str, Any]:
        tag = f"turn {turn}" if branch is None else f"turn {turn} branch {branch}"
        if turn % 4 == 0:
            return {"role": "user", "content": f"user follow-up ({tag}): continue, café →"}
        return {"role": "tool", "content": f"tool result ({tag}): {turn * 31 % 97} rows, größe ok"}

    def admission(self, model_call_id: str, parent: CallTrace | None) -> CaptureAdmission | None:
        if parent is None:
            return CaptureAdmission(rollout_id=self.rollout_id, model_call_id=model_call_id, mode="text")
        if not parent.staged or parent.coords is None:
            return None  # unresolved parent: the gate serves the call uncaptured
        inline = self.prefix_mode == "inline"
        return CaptureAdmission(
            rollout_id=self.rollout_id,
            model_call_id=model_call_id,
            parent_call_id=parent.model_call_id,
            prev_len=parent.coords.cum_len,
            mode="token_in",
            required_prefix_token_ids=parent.full_token_ids if inline else [],
            staging_chain=[] if inline else list(parent.staging_chain),
            parent_chain_hash=parent.coords.chain_hash,
        )

    def call(
        self,
        parent: CallTrace | None,
        history: list[dict[str, Any]],
        new: list[dict[str, Any]],
        role: CallRole,
        fail: bool,
    ) -> CallTrace:
        model_call_id = f"{self.rollout_id}.c{len(self.trace.calls):03d}"
        admission = self.admission(model_call_id, parent)
        request_items = history + new
        render = self.engine.tokenizer.render_chat
        coords: CommitCoords | None = None
        if admission is None:
            prompt = render(request_items)
            generation = self.engine.generate(prompt, self.max_tokens, min_tokens=self.min_tokens)
        else:
            explicit = None
            if admission.staging_chain and self.prefix_source is not None:
                explicit = resolve_prefix(admission, self.prefix_source)  # the host resolves the chain itself
            active = self.capture.begin_call(admission, prefix_token_ids=explicit)
            if admission.mode == "token_in" and not active.capture_failed:
                prompt = active.prefix_token_ids + render(new)
            else:
                prompt = render(request_items)
            generation = self.engine.generate(prompt, self.max_tokens, min_tokens=self.min_tokens)
            if fail:
                coords = self.capture.fail_call(active, reason="injected capture failure")
            elif self.use_adapter:
                coords = self.capture.complete_call_from_response(active, self.engine.chat_response(prompt, generation))
            else:
                coords = self.capture.complete_call(
                    active,
                    prompt_token_ids=prompt,
                    generated_token_ids=generation.token_ids,
                    generated_logprobs=generation.logprobs,
                )
        text = self.engine.tokenizer.decode(generation.token_ids)
        trace = CallTrace(
            model_call_id=model_call_id,
            role=role,
            admission=admission,
            coords=coords,
            prompt_token_ids=prompt,
            generation=generation,
            request_items=request_items,
            response_items=[{"role": "assistant", "content": text}],
        )
        if trace.staged and coords is not None and coords.staging_key is not None:
            trace.staging_chain = (parent.staging_chain if parent else ()) + (coords.staging_key,)
        self.trace.calls.append(trace)
        return trace


def simulate_rollout(
    capture: RolloutTokenCapture,
    engine: SimulatedEngine,
    *,
    rollout_id: str,
    turns: int,
    max_tokens: int = 64,
    min_tokens: int = 0,
    prefix_mode: Literal["inline", "chain"] = "inline",
    use_adapter: bool = False,
    prefix_source: Any = None,
    retry_turns: Collection[int] = (),
    abandoned_branch_turns: Collection[int] = (),
    branch_length: int = 1,
    fail_turns: Collection[int] = (),
) -> RolloutTrace:
    """Run one multi-turn agent rollout through *capture* and return its trace.

    Turn 0 is the text root (system + user); every later turn appends a tool
    result (every fourth a user message) and continues token-in from the
    previous main call. At a turn in *retry_turns* the call is issued twice
    (the first attempt becomes a childless sibling); at a turn in
    *abandoned_branch_turns* a side branch of *branch_length* calls is run
    from the current head and abandoned; at a turn in *fail_turns* the host
    fails the call (``fail_call``), so later calls are served uncaptured.

    :param prefix_mode: ``inline`` admissions carry the prefix; ``chain``
        admissions carry ``staging_chain`` (resolved by the capture's source,
        or by the host from *prefix_source* when given).
    :param use_adapter: complete through ``complete_call_from_response`` with
        a vLLM-shaped payload (the capture needs a ``VLLMChatAdapter``).
    :raises ValueError: ``turns < 1``.
    """
    if turns < 1:
        raise ValueError("a rollout needs at least one turn")
    trace = RolloutTrace(rollout_id)
    driver = _Driver(
        capture, engine, rollout_id, max_tokens, min_tokens, prefix_mode, use_adapter, prefix_source, trace
    )
    history: list[dict[str, Any]] = []
    head: CallTrace | None = None
    for turn in range(turns):
        if turn == 0:
            new = [
                {"role": "system", "content": "You are a careful agent. Use tools."},
                {"role": "user", "content": f"Task for {rollout_id}: summarise the data → report."},
            ]
        else:
            new = [driver.observation(turn)]
        if turn in abandoned_branch_turns and head is not None:
            branch_head, branch_history = head, list(history)
            for index in range(branch_length):
                branch_new = [driver.observation(turn, index)]
                branch_call = driver.call(branch_head, branch_history, branch_new, "branch", fail=False)
                branch_history += branch_new + branch_call.response_items
                branch_head = branch_call
        if turn in retry_turns:
            driver.call(head, history, new, "retried", fail=False)
        head = driver.call(head, history, new, "main", fail=turn in fail_turns)
        history = history + new + head.response_items
    trace.terminal_model_call_id = head.model_call_id if head is not None and head.staged else None
    return trace
