"""Engine payload adapters and the serving-layer hook (contract §5.1).

An adapter attaches the exact prefix to an engine request and extracts the
exact prompt ids, generated ids, log-probabilities and extras from the engine
response. Adapters are strict: bools, non-int ids, non-numeric log-probs and
length mismatches are rejected (``TypeError`` / ``ValueError``), and numeric
log-probs are converted with ``float()``. No engine library is imported;
payloads are JSON mappings or plain objects (tensors/arrays are accepted
through their ``tolist()``).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any

from sink.contract.protocols import StagingSink
from worker.capture import RolloutTokenCapture
from worker.capture_adapter import CaptureAdapter

__all__ = (
    "PREFIX_REQUEST_KEY",
    "CaptureAdapter",
    "MegatronAdapter",
    "VLLMChatAdapter",
    "install_capture",
    "logprob_list",
    "token_id_list",
)

PREFIX_REQUEST_KEY = "required_prefix_token_ids"
"""Request key under which both adapters hand the exact prefix to the engine."""

_TOKEN_ID_PREFIX = "token_id:"
_MISSING = object()


def _field(payload: Any, *names: str) -> Any:
    """The first present field among *names* (mapping key or attribute), else ``_MISSING``."""
    for name in names:
        if isinstance(payload, Mapping):
            if name in payload:
                return payload[name]
        elif hasattr(payload, name):
            return getattr(payload, name)
    return _MISSING


def _required(payload: Any, *names: str) -> Any:
    value = _field(payload, *names)
    if value is _MISSING:
        raise ValueError(f"engine payload has none of the fields {names}")
    return value


def _as_list(value: Any, what: str) -> list[Any]:
    if isinstance(value, list):
        return value
    if isinstance(value, tuple):
        return list(value)
    tolist = getattr(value, "tolist", None)  # numpy arrays / torch tensors, without importing them
    if callable(tolist):
        converted = tolist()
        if isinstance(converted, list):
            return converted
    raise TypeError(f"{what} must be a list, got {type(value).__name__}")


def token_id_list(value: Any, what: str = "token ids") -> list[int]:
    """*value* as a list of exact non-negative ints.

    :raises TypeError: not a list, or an element is not an ``int`` (bools included).
    :raises ValueError: a negative id.
    """
    ids = _as_list(value, what)
    if not set(map(type, ids)) <= {int}:
        raise TypeError(f"{what} must be ints (bools and floats are rejected)")
    if ids and min(ids) < 0:
        raise ValueError(f"{what} must be non-negative")
    return ids


def logprob_list(value: Any, what: str = "log-probabilities") -> list[float]:
    """*value* as a list of Python floats, converting real numbers with ``float()``.

    :raises TypeError: not a list, or an element is a bool or not a real number.
    """
    values = _as_list(value, what)
    kinds = set(map(type, values))
    if kinds <= {float}:
        return values
    for kind in kinds:
        if kind is bool or not issubclass(kind, numbers.Real):
            raise TypeError(f"{what} must be real numbers, got {kind.__name__}")
    return list(map(float, values))


def _same_length(ids: list[int], logprobs: list[float]) -> tuple[list[int], list[float]]:
    if len(ids) != len(logprobs):
        raise ValueError(f"{len(ids)} generated ids but {len(logprobs)} log-probabilities")
    return ids, logprobs


def _with_prefix(request: Any, prefix_ids: list[int]) -> dict[str, Any]:
    if not isinstance(request, Mapping):
        raise TypeError(f"engine request must be a mapping, got {type(request).__name__}")
    updated = dict(request)
    if prefix_ids:
        updated[PREFIX_REQUEST_KEY] = list(token_id_list(prefix_ids, "prefix ids"))
    else:
        updated.pop(PREFIX_REQUEST_KEY, None)
    return updated


class VLLMChatAdapter:
    """vLLM OpenAI chat-completion responses (``n == 1``).

    Reads ``prompt_token_ids`` at top level, generated ids from
    ``choices[0].token_ids`` when present, else from the
    ``choices[0].logprobs.content[*].token`` strings ``"token_id:<n>"``
    (request ``logprobs=true`` and ``return_tokens_as_token_ids=true``), the
    log-probs from ``logprobs.content[*].logprob`` and
    ``choices[0].message.routed_experts`` as extras.
    """

    def enter_prefix(self, request: Any, prefix_ids: list[int]) -> dict[str, Any]:
        """A copy of *request* with :data:`PREFIX_REQUEST_KEY` set (removed for an empty prefix).

        :raises TypeError: *request* is not a mapping or the ids are not ints.
        """
        return _with_prefix(request, prefix_ids)

    def extract_prompt_ids(self, response: Any) -> list[int]:
        """``response.prompt_token_ids``.

        :raises ValueError: missing or negative ids. :raises TypeError: non-int ids.
        """
        return token_id_list(_required(response, "prompt_token_ids"), "prompt_token_ids")

    def _choice(self, response: Any) -> Any:
        choices = _as_list(_required(response, "choices"), "choices")
        if len(choices) != 1:
            raise ValueError(f"capture needs exactly one choice (n == 1), got {len(choices)}")
        return choices[0]

    def extract_generation(self, response: Any) -> tuple[list[int], list[float]]:
        """Generated ids and log-probs of ``choices[0]``.

        :raises ValueError: missing fields, a malformed ``token_id:`` string,
            ids that disagree with ``token_ids``, or a length mismatch.
        :raises TypeError: non-int ids or non-numeric log-probs.
        """
        choice = self._choice(response)
        logprobs_block = _required(choice, "logprobs")
        if logprobs_block is None:
            raise ValueError("choices[0].logprobs is null: request logprobs=true")
        content = _as_list(_required(logprobs_block, "content"), "logprobs.content")
        logprobs = logprob_list([_required(entry, "logprob") for entry in content])
        explicit_ids = _field(choice, "token_ids")
        if explicit_ids is not _MISSING and explicit_ids is not None:
            return _same_length(token_id_list(explicit_ids, "choices[0].token_ids"), logprobs)
        tokens = [_required(entry, "token") for entry in content]
        if not set(map(type, tokens)) <= {str}:
            raise TypeError("logprobs.content[*].token must be strings")
        if not all(token.startswith(_TOKEN_ID_PREFIX) for token in tokens):
            raise ValueError("logprobs tokens must read 'token_id:<n>' (request return_tokens_as_token_ids=true)")
        digits = [token[len(_TOKEN_ID_PREFIX) :] for token in tokens]
        if not all(text.isdecimal() and text.isascii() for text in digits):
            raise ValueError("malformed 'token_id:<n>' token string")
        return _same_length(list(map(int, digits)), logprobs)

    def extract_extras(self, response: Any) -> dict[str, Any] | None:
        """``{"routed_experts": ...}`` from ``choices[0].message``, or ``None``.

        :raises ValueError: missing ``choices``.
        """
        message = _field(self._choice(response), "message")
        if message is _MISSING or message is None:
            return None
        experts = _field(message, "routed_experts")
        if experts is _MISSING or experts is None:
            return None
        return {"routed_experts": experts}


class MegatronAdapter:
    """Megatron-style payloads (mapping keys or object attributes).

    Prompt ids: ``prompt_token_ids`` or ``prompt_tokens``; generated ids:
    ``generated_token_ids`` or ``generated_tokens``; log-probs:
    ``generated_log_probs`` or ``log_probs``. When no prompt field exists,
    ``tokens`` is read as the full sequence (prompt + generated) and the
    prompt is its head. ``routed_experts`` becomes the extras.
    """

    def enter_prefix(self, request: Any, prefix_ids: list[int]) -> dict[str, Any]:
        """A copy of *request* with :data:`PREFIX_REQUEST_KEY` set (removed for an empty prefix).

        :raises TypeError: *request* is not a mapping or the ids are not ints.
        """
        return _with_prefix(request, prefix_ids)

    def extract_prompt_ids(self, response: Any) -> list[int]:
        """The prompt ids (see the class docstring).

        :raises ValueError: no prompt field, or ``tokens`` shorter than the generation.
        :raises TypeError: non-int ids.
        """
        prompt = _field(response, "prompt_token_ids", "prompt_tokens")
        if prompt is not _MISSING:
            return token_id_list(prompt, "prompt ids")
        full = token_id_list(_required(response, "tokens"), "tokens")
        generated = token_id_list(_required(response, "generated_token_ids", "generated_tokens"), "generated ids")
        if len(full) < len(generated) or full[len(full) - len(generated) :] != generated:
            raise ValueError("tokens does not end with the generated ids")
        return full[: len(full) - len(generated)]

    def extract_generation(self, response: Any) -> tuple[list[int], list[float]]:
        """Generated ids and their log-probs.

        :raises ValueError: missing fields or a length mismatch.
        :raises TypeError: non-int ids or non-numeric log-probs.
        """
        ids = token_id_list(_required(response, "generated_token_ids", "generated_tokens"), "generated ids")
        logprobs = logprob_list(_required(response, "generated_log_probs", "log_probs"))
        return _same_length(ids, logprobs)

    def extract_extras(self, response: Any) -> dict[str, Any] | None:
        """``{"routed_experts": ...}`` when the payload carries it, else ``None``."""
        experts = _field(response, "routed_experts")
        if experts is _MISSING or experts is None:
            return None
        return {"routed_experts": _as_list(experts, "routed_experts")}


def install_capture(
    serving_layer: Any,
    *,
    sink: Any,
    weight_version_fn: Callable[[], int],
    adapter: CaptureAdapter | None = None,
    source: Any = None,
) -> RolloutTokenCapture:
    """Build a :class:`RolloutTokenCapture` and install it with ``serving_layer.install_token_capture``.

    :raises TypeError: *sink* is not a ``StagingSink``, *weight_version_fn*
        is not callable, or the serving layer has no callable
        ``install_token_capture(capture)``.
    """
    if not isinstance(sink, StagingSink):
        raise TypeError(f"sink must implement StagingSink.stage(record), got {type(sink).__name__}")
    if not callable(weight_version_fn):
        raise TypeError("weight_version_fn must be callable")
    install = getattr(serving_layer, "install_token_capture", None)
    if not callable(install):
        raise TypeError(f"{type(serving_layer).__name__} has no callable install_token_capture(capture)")
    capture = RolloutTokenCapture(sink=sink, weight_version_fn=weight_version_fn, source=source, adapter=adapter)
    install(capture)
    return capture
