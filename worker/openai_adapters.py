"""Adapters for the OpenAI-compatible response shapes a capture proxy sees (contract §5.1, §13.2).

* :class:`VLLMCompletionAdapter`: vLLM ``/v1/completions`` (prompt ids at top level or on the choice,
  ``choices[0].token_ids``, else the ``"token_id:<n>"`` strings of ``choices[0].logprobs.tokens``; log-probs
  from ``token_logprobs``).
* :class:`NemoGymChatAdapter`: NeMo Gym's vLLM model server, which attaches ``prompt_token_ids``,
  ``generation_token_ids``, ``generation_log_probs`` (and ``routed_experts``) to ``choices[0].message``.
* :class:`NemoGymResponsesAdapter`: the same fields on the one Responses-API output item that carries them.
* :class:`OpenAIChatAdapter`: chat completions in either shape (message-level fields win when present).

Every extraction failure raises :class:`~worker.errors.EnginePayloadError` naming the field (as the adapters of
:mod:`worker.adapters` do: one convention); the capture turns it into failed coordinates (the completion is still
served, INV-4). ``token_id:<n>`` strings that disagree with ``token_ids``, and a reply with text but no generated id,
are refused the same way: the payload contradicts itself, so no row is built from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker.adapters import (
    VLLMChatAdapter,
    check_generated_text,
    cross_checked,
    ids_from_token_strings,
    logprob_list,
    message_text,
    token_id_list,
    with_prefix,
)
from worker.errors import EnginePayloadError

__all__ = (
    "NemoGymChatAdapter",
    "NemoGymResponsesAdapter",
    "OpenAIChatAdapter",
    "VLLMCompletionAdapter",
    "ids_from_token_strings",
)


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise EnginePayloadError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _get(payload: Mapping[str, Any], key: str, what: str) -> Any:
    if key not in payload or payload[key] is None:
        raise EnginePayloadError(f"engine response has no {what}")
    return payload[key]


def _only_choice(response: Any) -> Mapping[str, Any]:
    choices = _get(_mapping(response, "response"), "choices", "choices")
    if not isinstance(choices, list) or len(choices) != 1:
        count = len(choices) if isinstance(choices, list) else type(choices).__name__
        raise EnginePayloadError(f"capture needs exactly one choice (n == 1), got {count}")
    return _mapping(choices[0], "choices[0]")


def _same_length(ids: list[int], logprobs: list[float], what: str) -> tuple[list[int], list[float]]:
    if len(ids) != len(logprobs):
        raise EnginePayloadError(f"{what}: {len(ids)} generated ids but {len(logprobs)} log-probabilities")
    return ids, logprobs


class VLLMCompletionAdapter:
    """vLLM ``/v1/completions`` responses (``n == 1``): see the module docstring."""

    def enter_prefix(self, request: Any, prefix_ids: list[int]) -> dict[str, Any]:
        """A copy of *request* with ``required_prefix_token_ids`` set (removed for an empty prefix)."""
        return with_prefix(request, prefix_ids)

    def extract_prompt_ids(self, response: Any) -> list[int]:
        """``prompt_token_ids`` at top level, else on ``choices[0]``.

        :raises EnginePayloadError: missing or malformed.
        """
        top = _mapping(response, "response").get("prompt_token_ids")
        value = top if top is not None else _get(_only_choice(response), "prompt_token_ids", "prompt_token_ids")
        return token_id_list(value, "prompt_token_ids")

    def extract_generation(self, response: Any) -> tuple[list[int], list[float]]:
        """``choices[0].token_ids`` (or the ``token_id:<n>`` strings of ``logprobs.tokens``) and ``token_logprobs``.

        :raises EnginePayloadError: missing or malformed fields, or a length mismatch.
        """
        choice = _only_choice(response)
        block = _mapping(_get(choice, "logprobs", "choices[0].logprobs (request logprobs=0)"), "logprobs")
        logprobs = logprob_list(_get(block, "token_logprobs", "token_logprobs"), "token_logprobs")
        explicit = choice.get("token_ids")
        if explicit is not None:
            ids, _ = _same_length(token_id_list(explicit, "choices[0].token_ids"), logprobs, "choices[0]")
            cross_checked(ids, block.get("tokens"), "logprobs.tokens")
        else:
            ids = ids_from_token_strings(_get(block, "tokens", "logprobs.tokens"), "logprobs.tokens")
        check_generated_text(ids, choice.get("text"), "choices[0]")
        return _same_length(ids, logprobs, "choices[0]")

    def extract_extras(self, response: Any) -> dict[str, Any] | None:
        """``{"routed_experts": ...}`` from ``choices[0]``, or ``None``."""
        experts = _only_choice(response).get("routed_experts")
        return None if experts is None else {"routed_experts": experts}


def _message_level(item: Mapping[str, Any], what: str) -> tuple[list[int], list[int], list[float]]:
    prompt = token_id_list(_get(item, "prompt_token_ids", f"{what}.prompt_token_ids"), f"{what}.prompt_token_ids")
    ids = ids_from_token_strings(_get(item, "generation_token_ids", f"{what}.generation_token_ids"), what)
    logprobs = logprob_list(
        _get(item, "generation_log_probs", f"{what}.generation_log_probs"), f"{what}.generation_log_probs"
    )
    generated, logprobs = _same_length(ids, logprobs, what)
    return prompt, generated, logprobs


def _experts(item: Mapping[str, Any]) -> dict[str, Any] | None:
    experts = item.get("routed_experts")
    return None if experts is None else {"routed_experts": experts}


class NemoGymChatAdapter:
    """Chat completions with NeMo Gym's message-level token fields on ``choices[0].message``."""

    def enter_prefix(self, request: Any, prefix_ids: list[int]) -> dict[str, Any]:
        """A copy of *request* with ``required_prefix_token_ids`` set (removed for an empty prefix)."""
        return with_prefix(request, prefix_ids)

    def _message(self, response: Any) -> Mapping[str, Any]:
        return _mapping(_get(_only_choice(response), "message", "choices[0].message"), "choices[0].message")

    def extract_prompt_ids(self, response: Any) -> list[int]:
        """``choices[0].message.prompt_token_ids``. :raises EnginePayloadError: missing or malformed."""
        return _message_level(self._message(response), "choices[0].message")[0]

    def extract_generation(self, response: Any) -> tuple[list[int], list[float]]:
        """``generation_token_ids`` and ``generation_log_probs``. :raises EnginePayloadError: as above."""
        message = self._message(response)
        _, ids, logprobs = _message_level(message, "choices[0].message")
        check_generated_text(ids, message_text(message), "choices[0].message")
        return ids, logprobs

    def extract_extras(self, response: Any) -> dict[str, Any] | None:
        """``{"routed_experts": ...}`` from the message, or ``None``."""
        return _experts(self._message(response))


class NemoGymResponsesAdapter:
    """Responses-API payloads: the token fields sit on exactly one ``output`` item (the assistant message)."""

    def enter_prefix(self, request: Any, prefix_ids: list[int]) -> dict[str, Any]:
        """A copy of *request* with ``required_prefix_token_ids`` set (removed for an empty prefix)."""
        return with_prefix(request, prefix_ids)

    def _item(self, response: Any) -> Mapping[str, Any]:
        output = _get(_mapping(response, "response"), "output", "output")
        if not isinstance(output, list):
            raise EnginePayloadError(f"output must be a list, got {type(output).__name__}")
        carriers = [item for item in output if isinstance(item, Mapping) and "generation_token_ids" in item]
        if len(carriers) != 1:
            raise EnginePayloadError(f"exactly one output item must carry generation_token_ids, got {len(carriers)}")
        return carriers[0]

    def extract_prompt_ids(self, response: Any) -> list[int]:
        """The carrier item's ``prompt_token_ids``. :raises EnginePayloadError: missing or malformed."""
        return _message_level(self._item(response), "output item")[0]

    def extract_generation(self, response: Any) -> tuple[list[int], list[float]]:
        """The carrier item's generated ids and log-probs. :raises EnginePayloadError: as above."""
        _, ids, logprobs = _message_level(self._item(response), "output item")
        return ids, logprobs

    def extract_extras(self, response: Any) -> dict[str, Any] | None:
        """``{"routed_experts": ...}`` from the carrier item, or ``None``."""
        return _experts(self._item(response))


class OpenAIChatAdapter:
    """Chat completions in vLLM's shape or NeMo Gym's message-level shape (the latter wins when present)."""

    def __init__(self) -> None:
        self._vllm = VLLMChatAdapter()
        self._gym = NemoGymChatAdapter()

    def _message_level(self, response: Any) -> bool:
        try:
            message = _only_choice(response).get("message")
        except EnginePayloadError:
            return False
        return isinstance(message, Mapping) and "generation_token_ids" in message

    def enter_prefix(self, request: Any, prefix_ids: list[int]) -> dict[str, Any]:
        """A copy of *request* with ``required_prefix_token_ids`` set (removed for an empty prefix)."""
        return with_prefix(request, prefix_ids)

    def extract_prompt_ids(self, response: Any) -> list[int]:
        """Prompt ids of either shape. :raises EnginePayloadError: missing or malformed."""
        if self._message_level(response):
            return self._gym.extract_prompt_ids(response)
        return self._vllm.extract_prompt_ids(response)

    def extract_generation(self, response: Any) -> tuple[list[int], list[float]]:
        """Generated ids and log-probs of either shape. :raises EnginePayloadError: as above."""
        if self._message_level(response):
            return self._gym.extract_generation(response)
        return self._vllm.extract_generation(response)

    def extract_extras(self, response: Any) -> dict[str, Any] | None:
        """``routed_experts`` of either shape, or ``None``."""
        if self._message_level(response):
            return self._gym.extract_extras(response)
        return self._vllm.extract_extras(response)
