"""Engine payload adapters and the serving-layer hook (contract §5.1).

An adapter attaches the exact prefix to an engine request and extracts the
exact prompt ids, generated ids, log-probabilities and extras from the engine
response. Adapters are strict: a missing field, bools, non-int ids, non-numeric
log-probs, length mismatches and payloads that contradict themselves (``token_id:``
strings that disagree with ``token_ids``; text without a generated id) raise
:class:`~worker.errors.EnginePayloadError` naming the field, the one error every
adapter (here and in :mod:`worker.openai_adapters`) raises for a payload it cannot
read; the capture turns it into failed coordinates. Numeric log-probs are converted
with ``float()``. No engine library is imported; payloads are JSON mappings or
plain objects (tensors/arrays are accepted through their ``tolist()``).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any

from sink.contract.digest import is_token_id_list
from sink.contract.protocols import StagingSink
from worker.capture import RolloutTokenCapture
from worker.capture_adapter import CaptureAdapter
from worker.errors import EnginePayloadError

__all__ = (
    "PREFIX_REQUEST_KEY",
    "CaptureAdapter",
    "MegatronAdapter",
    "VLLMChatAdapter",
    "check_generated_text",
    "cross_checked",
    "ids_from_token_strings",
    "install_capture",
    "logprob_list",
    "message_text",
    "token_id_list",
    "with_prefix",
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
        raise EnginePayloadError(f"engine payload has none of the fields {names}")
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
    raise EnginePayloadError(f"{what} must be a list, got {type(value).__name__}")


def token_id_list(value: Any, what: str = "token ids") -> list[int]:
    """*value* as a list of exact non-negative ints.

    :raises EnginePayloadError: not a list, an element that is not an ``int`` (bools included), a negative id.
    """
    ids = _as_list(value, what)
    if is_token_id_list(ids):  # one marshal pass proves the usual case (exact ints in [0, 2**31))
        return ids
    if not set(map(type, ids)) <= {int}:
        raise EnginePayloadError(f"{what} must be ints (bools and floats are rejected)")
    if ids and min(ids) < 0:
        raise EnginePayloadError(f"{what} must be non-negative")
    return ids


def logprob_list(value: Any, what: str = "log-probabilities") -> list[float]:
    """*value* as a list of Python floats, converting real numbers with ``float()``.

    :raises EnginePayloadError: not a list, or an element is a bool or not a real number.
    """
    values = _as_list(value, what)
    kinds = set(map(type, values))
    if kinds <= {float}:
        return values
    for kind in kinds:
        if kind is bool or not issubclass(kind, numbers.Real):
            raise EnginePayloadError(f"{what} must be real numbers, got {kind.__name__}")
    return list(map(float, values))


def _spelled_as_ids(tokens: Any, ids: list[int]) -> bool:
    """Whether *tokens*, as many as *ids*, join into the ``token_id:<n>`` strings vLLM writes for *ids* (decimal, no
    sign, no leading zero), joined: one string compared, no string object per id.

    Then *ids* stand (:func:`cross_checked`): if every token starts with ``token_id:``, each holds exactly one (the
    joined strings hold ``len(ids)``, and digits never spell one), so they are vLLM's strings for *ids*; if one does
    not, the tokens are not all id strings, and such tokens check nothing.
    """
    if type(tokens) is not list or len(tokens) != len(ids):
        return False
    if not ids:
        return True
    try:
        joined = "".join(tokens)
        spelled = _TOKEN_ID_PREFIX + _decimals(ids).replace(",", _TOKEN_ID_PREFIX)  # commas only between ids
    except TypeError:  # an element that is not a str, an id orjson does not write (from 2**64): the general reading
        return False
    except ValueError:  # an id with more digits than str() writes (sys.get_int_max_str_digits): the general reading
        return False
    return joined == spelled


def _decimals(ids: list[int]) -> str:
    """``",".join(map(str, ids))`` for ids that are exact non-negative ints (the callers' ids are proved so).

    orjson writes an exact int as ``str()`` does (decimal digits, no sign for these, no leading zero) without a
    string object per id: about 6x faster at 2,048 ids. It comes with the proxy extra, where every captured
    call reads vLLM's strings; without it, ``str()`` per id.

    :raises TypeError: an id orjson refuses to write (from ``2**64``).
    """
    try:
        import orjson
    except ImportError:
        return ",".join(map(str, ids))
    return orjson.dumps(ids)[1:-1].decode()


def ids_from_token_strings(tokens: Any, what: str) -> list[int]:
    """Ids from ``"token_id:<n>"`` strings (vLLM's ``return_tokens_as_token_ids``); exact ints pass through.

    :raises EnginePayloadError: not a list, or an element that is neither an id nor a ``token_id:<n>`` string.
    """
    if not isinstance(tokens, list):
        raise EnginePayloadError(f"{what} must be a list, got {type(tokens).__name__}")
    ids: list[int] = []
    for token in tokens:
        if type(token) is int and token >= 0:
            ids.append(token)
            continue
        if not isinstance(token, str) or not token.startswith(_TOKEN_ID_PREFIX):
            raise EnginePayloadError(f"{what} entries must read 'token_id:<n>' (request return_tokens_as_token_ids)")
        digits = token[len(_TOKEN_ID_PREFIX) :]
        if not (digits.isdecimal() and digits.isascii()):
            raise EnginePayloadError(f"malformed token string {token!r} in {what}")
        try:
            ids.append(int(digits))
        except ValueError:  # more digits than int() reads (sys.get_int_max_str_digits)
            raise EnginePayloadError(f"token string of {len(digits)} digits in {what}: no token id") from None
    return ids


def cross_checked(ids: list[int], tokens: Any, what: str) -> list[int]:
    """*ids* (an explicit ``token_ids`` field), checked against the same generation's token strings when every one
    reads ``token_id:<n>`` (text tokens, which the client asked for itself, cannot be checked).

    :raises EnginePayloadError: the two disagree (the payload contradicts itself: neither is trusted).
    """
    if _spelled_as_ids(tokens, ids):  # vLLM's own strings for exactly these ids (the shortcut)
        return ids
    if not isinstance(tokens, list) or not all(isinstance(t, str) and t.startswith(_TOKEN_ID_PREFIX) for t in tokens):
        return ids
    if tokens and ids_from_token_strings(tokens, what) != ids:
        raise EnginePayloadError(f"{what} 'token_id:<n>' strings disagree with token_ids")
    return ids


def check_generated_text(ids: list[int], text: object, what: str) -> None:
    """A reply whose text (content, reasoning or tool calls) is not empty must have generated ids.

    :raises EnginePayloadError: no generated ids but text: the row would not hold what the agent was served.
    """
    if not ids and text:
        raise EnginePayloadError(f"{what}: no generated ids but non-empty text")


def _same_length(ids: list[int], logprobs: list[float], what: str = "choices[0]") -> tuple[list[int], list[float]]:
    if len(ids) != len(logprobs):
        raise EnginePayloadError(f"{what}: {len(ids)} generated ids but {len(logprobs)} log-probabilities")
    return ids, logprobs


def with_prefix(request: Any, prefix_ids: list[int]) -> dict[str, Any]:
    """A copy of *request* with :data:`PREFIX_REQUEST_KEY` set to *prefix_ids* (removed for an empty prefix).

    :raises TypeError: *request* is not a mapping (a caller bug, not an engine payload).
    :raises EnginePayloadError: the ids are not non-negative ints.
    """
    if not isinstance(request, Mapping):
        raise TypeError(f"engine request must be a mapping, got {type(request).__name__}")
    updated = dict(request)
    if prefix_ids:
        updated[PREFIX_REQUEST_KEY] = list(token_id_list(prefix_ids, "prefix ids"))
    else:
        updated.pop(PREFIX_REQUEST_KEY, None)
    return updated


def message_text(message: Any) -> list[Any]:
    """What the agent reads of a chat message: its non-empty content, reasoning and tool calls."""
    if message is _MISSING or message is None:
        return []
    found = (_field(message, name) for name in ("content", "reasoning", "reasoning_content", "tool_calls"))
    return [value for value in found if value not in (_MISSING, None, "", [])]


def _vllm_fast_path(response: Any) -> tuple[list[int], list[float]] | None:
    """vLLM's usual JSON (``choices[0].token_ids`` and ``logprobs.content``) read directly, or ``None`` to let the
    general path report the precise error."""
    try:
        [choice] = response["choices"]
        content = choice["logprobs"]["content"]
        logprobs = [entry["logprob"] for entry in content]
        tokens = [entry.get("token") for entry in content]
        ids = choice["token_ids"]
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        return None
    if type(ids) is not list or type(logprobs) is not list:
        return None
    generated, values = _same_length(
        token_id_list(ids, "choices[0].token_ids"), logprob_list(logprobs, "logprobs.content[*].logprob"), "choices[0]"
    )
    cross_checked(generated, tokens, "logprobs.content")
    check_generated_text(generated, message_text(choice.get("message")), "choices[0]")
    return generated, values


class VLLMChatAdapter:
    """vLLM OpenAI chat-completion responses (``n == 1``).

    Reads ``prompt_token_ids`` at top level, generated ids from
    ``choices[0].token_ids`` when present (checked against the
    ``logprobs.content[*].token`` strings when these read ``"token_id:<n>"``),
    else from those strings (request ``logprobs=true`` and
    ``return_tokens_as_token_ids=true``), the log-probs from
    ``logprobs.content[*].logprob`` and ``routed_experts`` (on ``choices[0]`` or its message) as
    extras. A reply with text but no generated id is refused.
    """

    def enter_prefix(self, request: Any, prefix_ids: list[int]) -> dict[str, Any]:
        """A copy of *request* with :data:`PREFIX_REQUEST_KEY` set (removed for an empty prefix).

        :raises TypeError: *request* is not a mapping. :raises EnginePayloadError: the ids are not ints.
        """
        return with_prefix(request, prefix_ids)

    def extract_prompt_ids(self, response: Any) -> list[int]:
        """``response.prompt_token_ids``. :raises EnginePayloadError: missing, negative or non-int ids."""
        return token_id_list(_required(response, "prompt_token_ids"), "prompt_token_ids")

    def _choice(self, response: Any) -> Any:
        choices = _as_list(_required(response, "choices"), "choices")
        if len(choices) != 1:
            raise EnginePayloadError(f"capture needs exactly one choice (n == 1), got {len(choices)}")
        return choices[0]

    def extract_generation(self, response: Any) -> tuple[list[int], list[float]]:
        """Generated ids and log-probs of ``choices[0]``.

        :raises EnginePayloadError: missing fields, a malformed ``token_id:`` string, ids that disagree with
            ``token_ids``, non-int ids, non-numeric log-probs, a length mismatch, or text without a generated id.
        """
        fast = _vllm_fast_path(response)
        if fast is not None:
            return fast
        choice = self._choice(response)
        logprobs_block = _required(choice, "logprobs")
        if logprobs_block is None:
            raise EnginePayloadError("choices[0].logprobs is null: request logprobs=true")
        content = _as_list(_required(logprobs_block, "content"), "logprobs.content")
        logprobs = logprob_list([_required(entry, "logprob") for entry in content])
        tokens = [_field(entry, "token") for entry in content]
        explicit_ids = _field(choice, "token_ids")
        if explicit_ids is not _MISSING and explicit_ids is not None:
            ids, _ = _same_length(token_id_list(explicit_ids, "choices[0].token_ids"), logprobs)
            cross_checked(ids, tokens, "logprobs.content")
        elif not set(map(type, tokens)) <= {str}:
            raise EnginePayloadError("logprobs.content[*].token must be strings")
        else:
            ids, _ = _same_length(ids_from_token_strings(tokens, "logprobs.content[*].token"), logprobs)
        check_generated_text(ids, message_text(_field(choice, "message")), "choices[0]")
        return ids, logprobs

    def extract_extras(self, response: Any) -> dict[str, Any] | None:
        """``{"routed_experts": ...}`` from ``choices[0]`` (vLLM 0.32: base64 of a ``.npy`` array, kept as sent) or
        from ``choices[0].message`` (older engines), or ``None``.

        :raises EnginePayloadError: missing ``choices``, or routed experts on the choice and the message that differ.
        """
        choice = self._choice(response)
        on_choice = _field(choice, "routed_experts")
        message = _field(choice, "message")
        on_message = None if message is _MISSING or message is None else _field(message, "routed_experts")
        found = [experts for experts in (on_choice, on_message) if experts is not _MISSING and experts is not None]
        if len(found) > 1 and found[0] != found[1]:
            raise EnginePayloadError("routed_experts on choices[0] and on choices[0].message disagree")
        return {"routed_experts": found[0]} if found else None


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

        :raises TypeError: *request* is not a mapping. :raises EnginePayloadError: the ids are not ints.
        """
        return with_prefix(request, prefix_ids)

    def extract_prompt_ids(self, response: Any) -> list[int]:
        """The prompt ids (see the class docstring).

        :raises EnginePayloadError: no prompt field, ``tokens`` not ending with the generation, or non-int ids.
        """
        prompt = _field(response, "prompt_token_ids", "prompt_tokens")
        if prompt is not _MISSING:
            return token_id_list(prompt, "prompt ids")
        full = token_id_list(_required(response, "tokens"), "tokens")
        generated = token_id_list(_required(response, "generated_token_ids", "generated_tokens"), "generated ids")
        if len(full) < len(generated) or full[len(full) - len(generated) :] != generated:
            raise EnginePayloadError("tokens does not end with the generated ids")
        return full[: len(full) - len(generated)]

    def extract_generation(self, response: Any) -> tuple[list[int], list[float]]:
        """Generated ids and their log-probs.

        :raises EnginePayloadError: missing fields, a length mismatch, non-int ids or non-numeric log-probs.
        """
        ids = token_id_list(_required(response, "generated_token_ids", "generated_tokens"), "generated ids")
        logprobs = logprob_list(_required(response, "generated_log_probs", "log_probs"))
        return _same_length(ids, logprobs, "generation")

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
