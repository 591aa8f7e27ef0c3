"""Structured outputs on the simulated engine: the constraint render puts in ``sampling_params``, and the text a
constrained generation holds.

As vLLM 0.32, render turns ``structured_outputs`` (``choice``, ``json``, ``json_object``, ...), a ``response_format``
(``json_schema``: its schema; ``json_object``) and a named or ``required`` ``tool_choice`` (the tool's parameters
schema; an array of ``{name, parameters}`` calls) into ``sampling_params.structured_outputs``, every field written.
The simulated engine then generates, in place of sampled text:

* ``choice``: the first choice;
* ``json``: the schema's plainest instance, compact (every property; strings empty, numbers 0, booleans false, arrays
  of ``minItems`` items; the first of an ``enum`` or ``anyOf``);
* ``json_object``: ``{}``;

then the end-of-turn id, every id with log-prob 0.0 (vLLM reports the constrained distribution's log-prob: a forced
token's is 0.0). ``regex``, ``grammar`` and ``structural_tag`` are carried but not honoured (free text).

The simulated engine's ``tool_calls`` option (``staging-sink engine --tool-calls``) makes render constrain a request
naming tools (``tool_choice`` absent or ``auto``) to a pythonic call of its first tool, ``[name()]``, so that the
generation holds a tool call (:mod:`sink_tools.simulated.parsers` parses it back).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ("BadStructuredRequest", "constraint_of_chat", "forced_text")

_FIELDS: dict[str, Any] = {
    "json": None,
    "regex": None,
    "choice": None,
    "grammar": None,
    "json_object": None,
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "whitespace_pattern": None,
    "structural_tag": None,
    "_backend": None,
    "_backend_was_auto": False,
}


class BadStructuredRequest(ValueError):
    """A constraint the real engine refuses with 400 (an unknown named tool, a malformed ``structured_outputs``)."""


def _tools(request: dict[str, Any]) -> list[dict[str, Any]]:
    tools = request.get("tools")
    if not isinstance(tools, list):
        return []
    return [tool["function"] for tool in tools if isinstance(tool, dict) and isinstance(tool.get("function"), dict)]


def _full(**given: Any) -> dict[str, Any]:
    return {**_FIELDS, **given}


def _named_tool(request: dict[str, Any]) -> str | None:
    choice = request.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        return name if isinstance(name, str) else None
    return None


def constraint_of_chat(request: dict[str, Any], *, tool_calls: bool) -> dict[str, Any] | None:
    """``sampling_params.structured_outputs`` of a chat request (``None``: unconstrained).

    :param tool_calls: the engine's ``tool_calls`` option (see the module docstring).
    :raises BadStructuredRequest: a named tool the request does not define, or a ``structured_outputs`` that is not
        an object.
    """
    given = request.get("structured_outputs")
    if given is not None:
        if not isinstance(given, dict):
            raise BadStructuredRequest("structured_outputs must be an object")
        return _full(**{key: value for key, value in given.items() if key in _FIELDS})
    tools = _tools(request)
    named = _named_tool(request)
    if named is not None:
        parameters = next((tool.get("parameters") for tool in tools if tool.get("name") == named), None)
        if not any(tool.get("name") == named for tool in tools):
            raise BadStructuredRequest(f"Tool '{named}' has not been passed in `tools`.")
        return _full(json=parameters or {"type": "object", "properties": {}})
    if request.get("tool_choice") == "required" and tools:
        calls = [
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.get("name")]},
                    "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
                },
                "required": ["name", "parameters"],
            }
            for tool in tools
        ]
        return _full(json={"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}})
    response_format = request.get("response_format")
    if isinstance(response_format, dict):
        if response_format.get("type") == "json_schema":
            schema = (response_format.get("json_schema") or {}).get("schema")
            return _full(json=schema if isinstance(schema, dict) else {})
        if response_format.get("type") == "json_object":
            return _full(json_object=True)
    if tool_calls and tools and request.get("tool_choice", "auto") == "auto":
        return _full(choice=[f"[{tools[0].get('name') or 'tool'}()]"])
    return None


def _instance(schema: Any) -> Any:
    """The plainest instance of a JSON schema (see the module docstring)."""
    if not isinstance(schema, dict):
        return {}
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return _instance(schema[key][0])
    kind = schema.get("type")
    if kind == "array":
        return [_instance(schema.get("items")) for _ in range(int(schema.get("minItems") or 0))]
    if kind == "string":
        return ""
    if kind in ("integer", "number"):
        return 0
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    properties = schema.get("properties")
    return {name: _instance(sub) for name, sub in properties.items()} if isinstance(properties, dict) else {}


def forced_text(constraint: dict[str, Any] | None) -> str | None:
    """The text a generation under *constraint* holds (``None``: free text)."""
    if not constraint:
        return None
    choice = constraint.get("choice")
    if isinstance(choice, list) and choice and isinstance(choice[0], str):
        return choice[0]
    if constraint.get("json") is not None:
        return json.dumps(_instance(constraint["json"]), separators=(",", ":"), ensure_ascii=False)
    if constraint.get("json_object"):
        return "{}"
    return None
