"""The simulated engine's reasoning and tool-call parsers, shared by its chat route and its derender route.

* **Reasoning** (the ``reasoning_field`` option, vLLM's ``--reasoning-parser deepseek_r1``): the generation prompt
  opens the reasoning, so the ids before the first ``</think>`` (:data:`THINK_END`) are reasoning and the ids after
  it are content; without ``</think>`` the whole output is reasoning and ``content`` is ``null``. A reasoning engine's
  free generations hold ``</think>`` in place of the first ASCII character at or after the middle of the text
  (:func:`think`); a ``logit_bias <= -50`` on it keeps the whole output reasoning.
* **Tool calls** (vLLM's ``--tool-call-parser pythonic --enable-auto-tool-choice``), for a request naming ``tools``
  (``tool_choice`` not ``none``): a content that is exactly a pythonic call list, ``[name(arg='v', n=1), ...]``
  (keyword arguments with literal values), becomes ``message.tool_calls`` (arguments as JSON) and ``content`` is
  ``null``; under a named ``tool_choice`` the content is the JSON arguments of that tool, under ``required`` a JSON
  list of ``{name, parameters}``, and ``content`` is ``""``.

Generations hold a tool call when constrained to one (:mod:`sink_tools.simulated.structured`: a ``structured_outputs``
choice such as ``["[lookup(q='x')]"]``, a named ``tool_choice``, or the engine's ``tool_calls`` option).
"""

from __future__ import annotations

import ast
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sink_tools.simulated.engine import BYTE_OFFSET, IM_END, IM_START, Generation

__all__ = ("THINK_END", "Parsed", "message_of", "parse", "text_of", "think", "token_string", "tool_call_id")

THINK_END = 4
"""The id of ``</think>`` (as in the vLLM tier's tiny models)."""
SPECIAL_NAMES = {
    0: "<|endoftext|>",
    IM_START: "<|im_start|>",
    IM_END: "<|im_end|>",
    3: "<think>",
    THINK_END: "</think>",
}
_HIDDEN = frozenset({0, IM_START, IM_END})
"""Specials a detokenizer skips (``</think>`` and ``<think>`` are added tokens the text shows, as in the tiny models)."""
_FORBID = -50.0


def token_string(token: int) -> str:
    """A token's string, as vLLM's log-prob entries show it (a special's name; a byte's UTF-8 text)."""
    name = SPECIAL_NAMES.get(token)
    if name is not None:
        return name
    return bytes([token - BYTE_OFFSET]).decode("utf-8", errors="replace") if token >= BYTE_OFFSET else ""


def text_of(ids: Sequence[int], *, keep_specials: bool = False) -> str:
    """The text of *ids*: bytes decoded (invalid UTF-8 as U+FFFD), specials skipped or shown by name."""
    out: list[str] = []
    run = bytearray()
    for token in ids:
        if token >= BYTE_OFFSET:
            run.append(token - BYTE_OFFSET)
            continue
        out.append(run.decode("utf-8", errors="replace"))
        run.clear()
        if keep_specials or token not in _HIDDEN:
            out.append(SPECIAL_NAMES.get(token, ""))
    out.append(run.decode("utf-8", errors="replace"))
    return "".join(out)


def think(generation: Generation, logit_bias: dict[str, Any] | None) -> Generation:
    """A reasoning engine's free generation: ``</think>`` in place of the first ASCII character at or after the
    middle of the text (none found, or forbidden by *logit_bias*: the whole output stays reasoning)."""
    bias = (logit_bias or {}).get(str(THINK_END), 0.0)
    if isinstance(bias, int | float) and bias <= _FORBID:
        return generation
    ids = generation.token_ids
    text = len(ids) - (1 if ids and ids[-1] == IM_END else 0)
    at = next((i for i in range(text // 2, text) if BYTE_OFFSET <= ids[i] < BYTE_OFFSET + 0x80), None)
    if at is None or at == 0:
        return generation
    return Generation([*ids[:at], THINK_END, *ids[at + 1 :]], generation.logprobs, generation.finish_reason)


@dataclass(frozen=True)
class Parsed:
    """One output through the parsers."""

    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]]
    """``[{name, arguments}]`` (ids are given by the route that answers)."""
    auto: bool
    """The calls came from the auto tool parser (the chat route answers ``finish_reason: "tool_calls"``)."""


def _pythonic(text: str) -> list[dict[str, Any]] | None:
    stripped = text.strip()
    if not (stripped.startswith("[") and stripped.endswith("]")):
        return None
    try:
        tree = ast.parse(stripped, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
            return None
        try:
            arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
        except ValueError:
            return None
        if None in arguments:
            return None
        calls.append({"name": node.func.id, "arguments": json.dumps(arguments, ensure_ascii=False)})
    return calls


def _forced_calls(text: str, request: dict[str, Any]) -> list[dict[str, Any]]:
    choice = request.get("tool_choice")
    if isinstance(choice, dict):
        return [{"name": (choice.get("function") or {}).get("name"), "arguments": text}]
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    return [
        {"name": item.get("name"), "arguments": json.dumps(item.get("parameters"), ensure_ascii=False)}
        for item in items
        if isinstance(item, dict)
    ]


def parse(ids: Sequence[int], request: dict[str, Any], *, reasoning: bool, keep_specials: bool) -> Parsed:
    """Run the parsers on output *ids* for chat *request* (see the module docstring)."""
    thought: str | None = None
    content_ids = list(ids)
    if reasoning:
        if THINK_END in content_ids:
            cut = content_ids.index(THINK_END)
            thought = text_of(content_ids[:cut], keep_specials=keep_specials)
            content_ids = content_ids[cut + 1 :]
        else:
            thought, content_ids = text_of(content_ids, keep_specials=keep_specials), []
    content: str | None = text_of(content_ids, keep_specials=keep_specials)
    if reasoning and not content:
        content = None
    tools = request.get("tools")
    choice = request.get("tool_choice")
    if not (isinstance(tools, list) and tools) or choice == "none" or content is None:
        return Parsed(thought, content, [], auto=False)
    if isinstance(choice, dict) or choice == "required":
        return Parsed(thought, "", _forced_calls(content, request), auto=False)
    calls = _pythonic(content)
    if calls is None:
        return Parsed(thought, content, [], auto=False)
    return Parsed(thought, None, calls, auto=True)


def tool_call_id(*, chat_route: bool) -> str:
    """A tool call's id: ``chatcmpl-tool-<16 hex>`` on the chat route, 32 hex digits from derender (as vLLM)."""
    return f"chatcmpl-tool-{secrets.token_hex(8)}" if chat_route else secrets.token_hex(16)


def message_of(parsed: Parsed, *, reasoning_field: str | None, chat_route: bool) -> dict[str, Any]:
    """vLLM 0.32's assistant message: ``tool_calls`` only when there are calls; the reasoning under
    *reasoning_field* (``reasoning``, or ``reasoning_content`` as older vLLM)."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": parsed.content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
    }
    if parsed.tool_calls:
        message["tool_calls"] = [
            {"id": tool_call_id(chat_route=chat_route), "type": "function", "function": call}
            for call in parsed.tool_calls
        ]
    message[reasoning_field or "reasoning"] = parsed.reasoning
    return message
