"""What vLLM 0.32 answers on its chat, render, generate and derender routes, reduced to shapes.

The recording (``tests/data/vllm_shapes.json``) holds, per case, the *shapes* of the real engine's answers: key sets,
null versus absent, value types, the sampling fields render keeps (and the defaults it omits), counts, finish and stop
reasons, the token strings of special tokens; never the tiny model's gibberish text or its log-prob values. Every
case is built so that its shapes do not depend on which model sampled (forced end-of-turn, forbidden end-of-turn with
a fixed ``max_tokens``, a ``structured_outputs`` choice), so the simulated engine must answer the same requests with
the same shapes (``tests/test_simulated_vs_vllm.py``, fast tier), and the live vLLM must still answer what was
recorded (the same file, ``vllm`` tier).

Regenerate the recording from running servers (a ``STAGING_SINK_VLLM_REUSE`` folder, see
:mod:`tests.helpers.vllm_fixtures`)::

    .venv/bin/python -m tests.helpers.vllm_shapes /tmp/vx

The tiny models and the simulated engine share the ids the requests bias: ``<|im_start|>`` 1, ``<|im_end|>`` 2 and
``</think>`` 4 (the models' ``<|endoftext|>`` 0 and ``<think>`` 3 are forbidden; the simulated engine never samples
them).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

__all__ = ("CASES", "RECORDING", "Case", "ShapeEngine", "record", "reduce", "run_case", "stream_shape")

RECORDING = Path(__file__).resolve().parent.parent / "data" / "vllm_shapes.json"
MAX_MODEL_LEN = 1024
EOT = "2"
THINK_END = "4"
HIDDEN = {"0": -100.0, "1": -100.0, "3": -100.0}
"""Specials the tiny models could sample and their text would hide: never sampled here."""
NO_EOT = {**HIDDEN, EOT: -100.0}
FORCE_EOT = {**HIDDEN, EOT: 100.0}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    }
]
TOOL_CALL = "[lookup(q='x')]"
_SPECIALS = ("<|im_end|>", "<|im_start|>", "<|endoftext|>")
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(token) for token in _SPECIALS) + ")")
_HEX = re.compile(r"[0-9a-f]{8,}")
_LITERAL_STRINGS = frozenset({"object", "role", "finish_reason", "stop_reason", "type", "param", "output_mode", "name"})
_CONTEXT = "<max_model_len - prompt>"
_LITERAL_INTS = frozenset({"index", "start", "end", "code", "priority", "completion_tokens", "reasoning_tokens"})


@dataclass(frozen=True)
class ShapeEngine:
    """An engine the cases run against: its base URL and served model name."""

    url: str
    model: str


class _Run:
    """One case's calls on one engine; every answer is kept raw (for facts) and reduced (for the recording)."""

    def __init__(self, engine: ShapeEngine, client: httpx.Client) -> None:
        self.engine = engine
        self.client = client
        self.out: dict[str, Any] = {}

    def call(self, path: str, body: dict[str, Any]) -> tuple[int, Any, bool]:
        """The status, the parsed answer (a stream's chunks as a list) and whether it was a stream."""
        answer = self.client.post(
            self.engine.url + path, content=orjson.dumps(body), headers={"content-type": "application/json"}
        )
        if answer.headers.get("content-type", "").startswith("text/event-stream"):
            lines = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
            assert lines and lines[-1] == "[DONE]", answer.text[-300:]
            return answer.status_code, [orjson.loads(line) for line in lines[:-1]], True
        return answer.status_code, orjson.loads(answer.content), False

    def post(self, step: str, path: str, body: dict[str, Any], *, context: int | None = None) -> Any:
        status, parsed, streamed = self.call(path, body)
        if streamed:
            self.out[step] = {"status": status, "stream": stream_shape([self.reduce(c, context) for c in parsed])}
        else:
            self.out[step] = {"status": status, "body": self.reduce(parsed, context)}
        return parsed

    def chat(self, step: str, **fields: Any) -> Any:
        return self.post(step, "/v1/chat/completions", self.request(**fields))

    def render(self, step: str, **fields: Any) -> Any:
        rendered = self.post(step, "/v1/chat/completions/render", self.request(**fields))
        if isinstance(rendered, dict) and "token_ids" in rendered:  # the sampling fields reduced against the context
            self.out[step] = {"status": 200, "body": self.reduce(rendered, MAX_MODEL_LEN - len(rendered["token_ids"]))}
        return rendered

    def generate(self, step: str, rendered: dict[str, Any]) -> Any:
        return self.post(step, "/inference/v1/generate", rendered, context=MAX_MODEL_LEN - len(rendered["token_ids"]))

    def derender(self, step: str, generated: dict[str, Any], rendered: dict[str, Any], **extra: Any) -> Any:
        body = {
            "model": self.engine.model,
            "generate_response": generated,
            "prompt_token_ids": rendered["token_ids"],
            "prompt_tokens": len(rendered["token_ids"]),
            **extra,
        }
        return self.post(step, "/v1/chat/completions/derender", body)

    def request(self, **fields: Any) -> dict[str, Any]:
        return {"model": self.engine.model, "messages": MESSAGES, **fields}

    def token_id(self, character: str) -> int:
        """The id the engine's tokenizer gives *character* (``/tokenize``: the engines' vocabularies differ)."""
        body = {"model": self.engine.model, "prompt": character, "add_special_tokens": False}
        status, answer, _ = self.call("/tokenize", body)
        assert status == 200 and len(answer["tokens"]) == 1, answer
        token: int = answer["tokens"][0]
        return token

    def fact(self, name: str, value: Any) -> None:
        self.out.setdefault("facts", {})[name] = value

    def reduce(self, value: Any, context: int | None) -> Any:
        return reduce(value, model=self.engine.model, context=context)


def stream_shape(chunks: list[Any]) -> list[Any]:
    """The shapes of a stream's chunks, uncounted, consecutive equal ones once.

    How many tokens a chunk carries is timing, not shape: vLLM hands a reader that fell behind every token it has not
    taken yet in one chunk (a busy machine sends fewer, larger chunks), so the counts of lists inside a chunk and the
    number of equal chunks in a row are left out; the token count is in the usage chunk."""
    out: list[Any] = []
    for chunk in chunks:
        shape = _uncounted(chunk)
        if not out or out[-1] != shape:
            out.append(shape)
    return out


def _uncounted(shape: Any) -> Any:
    if isinstance(shape, dict):
        return {k: _uncounted(v) for k, v in shape.items() if not (k == "n" and set(shape) == {"n", "of"})}
    if isinstance(shape, list):
        return [_uncounted(item) for item in shape]
    return shape


def _text(value: str) -> str:
    """A text with its special-token strings kept and every other run shown as ``…``."""
    return "".join(part if part in _SPECIALS else "…" for part in _SPECIAL_SPLIT.split(value) if part)


def _sampling(params: dict[str, Any], context: int | None) -> dict[str, Any]:
    out = dict(params)
    if context is not None and out.get("max_tokens") == context:
        out["max_tokens"] = _CONTEXT
    return out


def reduce(value: Any, *, model: str, context: int | None = None, key: str | None = None) -> Any:
    """The shape of an engine answer (see the module docstring); *context*: the count that fills the context (shown
    as ``<max_model_len - prompt>``: the prompts' lengths differ between engines)."""
    if isinstance(value, dict):
        if key == "sampling_params":
            return _sampling(value, context)
        if key in ("chat_template_kwargs", "stream_state"):
            return "dict"
        return {k: reduce(v, model=model, context=context, key=k) for k, v in value.items()}
    if isinstance(value, list):
        if not value:
            return []
        if not all(isinstance(item, dict) for item in value):
            return sorted({type(item).__name__ for item in value})
        shapes: list[Any] = []
        for item in value:
            shape = reduce(item, model=model, context=context)
            if shape not in shapes:
                shapes.append(shape)
        return {"n": len(value), "of": shapes}
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if key not in _LITERAL_INTS:
            return "int"
        return _CONTEXT if value == context else value
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        if key == "model":
            return "<model>" if value == model else value
        if key in ("id", "request_id"):
            return _HEX.sub("<hex>", value)
        if key == "system_fingerprint":
            return "vllm-0.32.0-<hash>" if value.startswith("vllm-0.32.0-") else value
        if key in _LITERAL_STRINGS or key == "stream_options":
            return value
        return _text(value)
    raise TypeError(f"unexpected JSON value {value!r}")


def _ids(generated: dict[str, Any]) -> list[int]:
    ids: list[int] = generated["choices"][0]["token_ids"]
    return ids


# --- the cases --------------------------------------------------------------------------------------------------


def render_defaults(run: _Run) -> None:
    """Render without ``max_tokens`` (it fills the context), with ``max_tokens: 16`` (vLLM's default: omitted) and
    ``max_completion_tokens`` over ``max_tokens``."""
    run.render("no_max_tokens")
    run.render("max_tokens_16", max_tokens=16)
    run.render("max_tokens_17", max_tokens=17)
    run.render("max_completion_tokens", max_completion_tokens=20, max_tokens=300)
    run.render("defaults_given", min_tokens=0, ignore_eos=False, top_k=0, temperature=1.0, logprobs=False)


def render_options(run: _Run) -> None:
    """Options render keeps, and greedy decoding dropping ``top_p``/``min_p``."""
    run.render("options", max_tokens=7, logprobs=True, top_logprobs=2, stop=["a"], ignore_eos=True, seed=1)
    run.render("more", min_tokens=2, top_k=5, top_p=0.9, presence_penalty=0.5, stop_token_ids=[7],
               include_stop_str_in_output=True, logit_bias={"7": 1.5})  # fmt: skip
    run.render("greedy", temperature=0, top_k=-1, logprobs=True)
    run.render("stream", stream=True, stream_options={"include_usage": True})
    run.render("choice", structured_outputs={"choice": ["a b"]})


def render_refusals(run: _Run) -> None:
    """``logprobs: false`` with ``top_logprobs`` is a 400; so is ``max_tokens`` over the context."""
    run.render("top_logprobs_without_logprobs", logprobs=False, top_logprobs=3)
    run.render("max_tokens_over_context", max_tokens=100_000)
    run.chat("chat_top_logprobs_without_logprobs", logprobs=False, top_logprobs=3, max_tokens=2)


def generate_fills_the_context(run: _Run) -> None:
    """A generate request without ``max_tokens`` (what render gives for ``max_tokens: 16``) fills the context."""
    rendered = run.render("render", max_tokens=16, logit_bias=NO_EOT)
    generated = run.generate("generate", rendered)
    run.fact("generated == max_model_len - prompt", len(_ids(generated)) == MAX_MODEL_LEN - len(rendered["token_ids"]))


def generate_and_derender(run: _Run) -> None:
    """Five ids (end-of-turn forbidden) with two top log-probs, back through derender with and without chat_request."""
    # Greedy: the sampled id is the top candidate, so the top log-probs list it once (a sampled id outside the top
    # two is listed first, then the two: the count would depend on the draw).
    rendered = run.render("render", max_tokens=5, logit_bias=NO_EOT, logprobs=True, top_logprobs=2, temperature=0.0)
    generated = run.generate("generate", rendered)
    run.derender("derender", generated, rendered)
    choice = generated["choices"][0]
    fewer = {**generated, "choices": [{**choice, "logprobs": {"content": choice["logprobs"]["content"][:3]}}]}
    run.derender("derender_fewer_logprobs", fewer, rendered)
    no_logprobs = {**generated, "choices": [{**choice, "logprobs": None}]}
    run.derender("derender_no_logprobs", no_logprobs, rendered)
    chat_request = run.request(max_tokens=5, logit_bias=NO_EOT, logprobs=True, top_logprobs=2, temperature=0.0)
    run.derender("derender_chat_request", generated, rendered, chat_request=chat_request)
    unasked = run.render("render_no_logprobs", max_tokens=3, logit_bias=NO_EOT)
    run.generate("generate_no_logprobs", unasked)


def end_of_turn(run: _Run) -> None:
    """A forced end-of-turn: generate's one id, derender's empty content, and the same with ``ignore_eos``."""
    rendered = run.render("render", max_tokens=4, logit_bias=FORCE_EOT, logprobs=True)
    generated = run.generate("generate", rendered)
    run.derender("derender", generated, rendered)
    rendered = run.render("render_ignore_eos", max_tokens=4, logit_bias=FORCE_EOT, logprobs=True, ignore_eos=True)
    generated = run.generate("generate_ignore_eos", rendered)
    run.derender("derender_ignore_eos", generated, rendered)


def stop_string(run: _Run) -> None:
    """A ``structured_outputs`` choice that meets a stop string: generate keeps the token completing it, derender
    keeps the string in the text, the chat route cuts it."""
    fields = {"max_tokens": 30, "structured_outputs": {"choice": ["hello world"]}, "stop": ["wor"], "logprobs": True}
    rendered = run.render("render", **fields)
    generated = run.generate("generate", rendered)
    derendered = run.derender("derender", generated, rendered)
    chat = run.chat("chat", **fields)
    run.fact("derender content", derendered["choices"][0]["message"]["content"])
    run.fact("chat content", chat["choices"][0]["message"]["content"])
    included = run.chat("chat_include_stop", include_stop_str_in_output=True, **fields)
    run.fact("chat content, stop string included", included["choices"][0]["message"]["content"])


def stop_token_ids(run: _Run) -> None:
    """``stop_token_ids`` on an id a ``logit_bias`` forces (``w``; its id asked of the engine): generation stops on it
    (``stop_reason`` the id, the id and its log-prob entry kept); the chat and completions routes leave its text out
    unless ``include_stop_str_in_output``, derender keeps it; ``min_tokens`` delays it; ``ignore_eos`` does not matter;
    a stop string its text completes is its ``stop_reason`` only when the output includes that text;
    an end-of-turn id in ``stop_token_ids`` stops with ``stop_reason`` the id only under ``ignore_eos``. Render is not
    recorded (its ``sampling_params`` hold the engine's id)."""
    w = run.token_id("w")
    fields = {"max_tokens": 6, "logit_bias": {**HIDDEN, str(w): 100.0}, "stop_token_ids": [w], "logprobs": True}
    status, rendered, _ = run.call("/v1/chat/completions/render", run.request(**fields))
    assert status == 200, rendered
    generated = run.generate("generate", rendered)
    run.fact("generate: the stop id, kept", _ids(generated) == [w] and generated["choices"][0]["stop_reason"] == w)
    derendered = run.derender("derender", generated, rendered)
    run.fact("derender content", derendered["choices"][0]["message"]["content"])
    status, rendered_stream, _ = run.call("/v1/chat/completions/render", run.request(stream=True, **fields))
    assert status == 200, rendered_stream
    streamed = run.generate("generate_stream", rendered_stream)
    run.fact("generate stream: the stop id, kept", [i for c in streamed for i in c["choices"][0]["token_ids"]] == [w])
    chat = run.chat("chat", return_token_ids=True, **fields)
    choice = chat["choices"][0]
    run.fact("chat content", choice["message"]["content"])
    run.fact("chat: the stop id, kept", choice["token_ids"] == [w] and choice["stop_reason"] == w)
    included = run.chat("chat_include_stop", include_stop_str_in_output=True, **fields)
    run.fact("chat content, stop token included", included["choices"][0]["message"]["content"])
    delayed = run.chat("chat_min_tokens", min_tokens=3, return_token_ids=True, **fields)
    ids = delayed["choices"][0]["token_ids"]
    run.fact("chat min_tokens 3: ids, the stop id last", [len(ids), ids.index(w) if w in ids else None])
    run.chat("chat_ignore_eos", ignore_eos=True, **fields)
    # The stop id's token also completes a stop string: the id wins, unless the output includes its text.
    run.chat("chat_stop_string_too", stop=["w"], **fields)
    run.chat("chat_stop_string_too_included", stop=["w"], include_stop_str_in_output=True, **fields)
    run.chat("chat_stream", stream=True, min_tokens=2, **fields)
    run.chat("chat_without_stop_token_ids", max_tokens=6, logit_bias=fields["logit_bias"], logprobs=True)
    eot = {"max_tokens": 4, "logit_bias": FORCE_EOT, "stop_token_ids": [int(EOT)]}
    run.chat("chat_end_of_turn", **eot)
    run.chat("chat_end_of_turn_ignore_eos", ignore_eos=True, **eot)
    completions = {"model": run.engine.model, "prompt": "Say hi.", "return_token_ids": True, **fields}
    for name, extra in (("completions", {}), ("completions, stop token included", {"include_stop_str_in_output": True})):
        status, answer, _ = run.call("/v1/completions", {**completions, "logprobs": 0, **extra})
        assert status == 200, answer
        choice = answer["choices"][0]
        run.fact(name, {"text": choice["text"], "finish_reason": choice["finish_reason"],
                        "stop_reason is the id": choice["stop_reason"] == w, "token_ids": len(choice["token_ids"]),
                        "log-prob entries": len(choice["logprobs"]["tokens"])})  # fmt: skip


def streams(run: _Run) -> None:
    """Streamed generate (eight ids), its streamed derender (one request per chunk, the state carried), and the
    streamed chat route."""
    rendered = run.render("render", max_tokens=8, logit_bias=NO_EOT, logprobs=True, stream=True)
    chunks = run.generate("generate", rendered)
    state = None
    derendered: list[Any] = []
    for chunk in chunks:
        body = {"stream": True, "model": run.engine.model, "generate_chunk": chunk, "stream_state": state,
                "prompt_token_ids": rendered["token_ids"], "prompt_tokens": len(rendered["token_ids"])}  # fmt: skip
        status, answer, _ = run.call("/v1/chat/completions/derender", body)
        assert status == 200, answer
        derendered.append(run.reduce(answer, None))
        state = answer["stream_state"]
    run.out["derender"] = {"status": 200, "stream": stream_shape(derendered)}
    options = {"stream_options": {"include_usage": True}, "max_tokens": 8, "logit_bias": NO_EOT}
    run.chat("chat", stream=True, **options)
    run.chat("chat_logprobs", stream=True, logprobs=True, **options)


def chat_route(run: _Run) -> None:
    """The chat route: log-probs, a forced end-of-turn (its token string), ``return_token_ids``, ``ignore_eos``."""
    run.chat("logprobs", max_tokens=4, logit_bias=NO_EOT, logprobs=True, top_logprobs=2)
    run.chat("end_of_turn", max_tokens=4, logit_bias=FORCE_EOT, logprobs=True)
    run.chat("return_token_ids", max_tokens=4, logit_bias=FORCE_EOT, return_token_ids=True)
    run.chat("return_token_ids_length", max_tokens=3, logit_bias=NO_EOT, return_token_ids=True)
    run.chat("ignore_eos", max_tokens=3, logit_bias=FORCE_EOT, ignore_eos=True, logprobs=True)


def reasoning(run: _Run) -> None:
    """The reasoning parser: render's reasoning fields; all reasoning (``</think>`` forbidden: content null); a split;
    streamed; an empty reply (a forced end-of-turn: reasoning ``""``, content null)."""
    no_think = {**NO_EOT, THINK_END: -100.0}
    rendered = run.render("render", max_tokens=6, logit_bias=no_think)
    run.chat("chat_all_reasoning", max_tokens=6, logit_bias=no_think)
    generated = run.generate("generate_all_reasoning", rendered)
    chat_request = run.request(max_tokens=6, logit_bias=no_think)
    run.derender("derender_all_reasoning", generated, rendered, chat_request=chat_request)
    run.derender("derender_without_chat_request", generated, rendered)
    split = {"max_tokens": 12, "logit_bias": {**NO_EOT, THINK_END: 1.0}, "seed": 4}  # one </think>, mid-output
    run.chat("chat_split", **split)
    rendered = run.render("render_split", **split)
    generated = run.generate("generate_split", rendered)
    run.derender("derender_split", generated, rendered, chat_request=run.request(**split))
    run.chat("chat_stream", max_tokens=8, logit_bias=no_think, stream=True, stream_options={"include_usage": True})
    rendered = run.render("render_empty", max_tokens=4, logit_bias=FORCE_EOT)
    generated = run.generate("generate_empty", rendered)
    chat_request = run.request(max_tokens=4, logit_bias=FORCE_EOT)
    run.derender("derender_empty", generated, rendered, chat_request=chat_request)
    no_ids = {**generated, "choices": [{**generated["choices"][0], "token_ids": []}]}
    run.derender("derender_no_ids", no_ids, rendered, chat_request=chat_request)
    run.chat("chat_empty", max_tokens=4, logit_bias=FORCE_EOT)


def tool_calls(run: _Run) -> None:
    """A pythonic tool call (forced by a ``structured_outputs`` choice): chat route (auto tool choice), derender of
    the ids without and with the stopping end-of-turn, a request with tools answered with text, and a named
    ``tool_choice`` (its JSON arguments constrained by the tool's schema)."""
    fields = {"tools": TOOLS, "max_tokens": 30, "structured_outputs": {"choice": [TOOL_CALL]}}
    chat = run.chat("chat_auto", **fields)
    run.fact("chat arguments", [call["function"]["arguments"] for call in chat["choices"][0]["message"]["tool_calls"]])
    rendered = run.render("render", **fields)
    generated = run.generate("generate", rendered)
    run.fact("generate ends on the end-of-turn", _ids(generated)[-1] == int(EOT))
    choice = generated["choices"][0]
    trimmed = {**generated, "choices": [{**choice, "token_ids": choice["token_ids"][:-1], "logprobs": None}]}
    derendered = run.derender("derender", trimmed, rendered, chat_request=run.request(**fields))
    message = derendered["choices"][0]["message"]
    run.fact("derender arguments", [call["function"]["arguments"] for call in message.get("tool_calls") or ()])
    run.derender("derender_with_end_of_turn", generated, rendered, chat_request=run.request(**fields))
    run.chat("chat_text", tools=TOOLS, max_tokens=4, logit_bias=NO_EOT)
    named = {"type": "function", "function": {"name": "lookup"}}
    run.render("render_named", tools=TOOLS, tool_choice=named)
    # The named tool's JSON arguments, kept short on the tiny model: no whitespace, '"' and '}' favoured.
    compact = {**HIDDEN, "99": -100.0, "100": -100.0, "68": 8.0, "97": 8.0}
    run.chat("chat_named", tools=TOOLS, tool_choice=named, max_tokens=40, logit_bias=compact, logprobs=True,
             temperature=0)  # fmt: skip


@dataclass(frozen=True)
class Case:
    """One recorded case: the model variant it runs on, and its calls."""

    name: str
    variant: str
    run: Callable[[_Run], None]


CASES = tuple(
    Case(run.__name__, variant, run)
    for variant, runs in (
        ("chatml", (render_defaults, render_options, render_refusals, generate_fills_the_context,
                    generate_and_derender, end_of_turn, stop_string, stop_token_ids, streams, chat_route)),
        ("reasoning", (reasoning,)),
        ("tools", (tool_calls,)),
    )
    for run in runs
)  # fmt: skip


def run_case(case: Case, engine: ShapeEngine) -> dict[str, Any]:
    """The reduced answers (and facts) of *case* on *engine*."""
    with httpx.Client(timeout=httpx.Timeout(600.0)) as client:
        run = _Run(engine, client)
        case.run(run)
    return run.out


def record(engines: dict[str, ShapeEngine]) -> dict[str, Any]:
    """Every case on the engine of its variant (*engines*: variant -> engine)."""
    return {case.name: run_case(case, engines[case.variant]) for case in CASES}


def dump(recording: dict[str, Any]) -> str:
    """*recording* as JSON text: one line per step, sorted keys."""
    lines = ["{", f' "vllm": {json.dumps(recording["vllm"])},', ' "cases": {']
    cases = sorted(recording["cases"].items())
    for index, (name, steps) in enumerate(cases):
        lines.append(f"  {json.dumps(name)}: {{")
        items = sorted(steps.items())
        for inner, (step, shape) in enumerate(items):
            comma = "," if inner < len(items) - 1 else ""
            lines.append(f"   {json.dumps(step)}: {json.dumps(shape, sort_keys=True, ensure_ascii=False)}{comma}")
        lines.append("  }" + ("," if index < len(cases) - 1 else ""))
    lines += [" }", "}"]
    return "\n".join(lines) + "\n"


def main(folder: str) -> None:
    """Record the running vLLM servers of a ``STAGING_SINK_VLLM_REUSE`` folder into :data:`RECORDING`."""
    root = Path(folder)
    engines = {v: ShapeEngine((root / f"{v}.url").read_text().strip(), v) for v in ("chatml", "reasoning", "tools")}
    recording = {"vllm": "0.32.0", "cases": record(engines)}
    RECORDING.parent.mkdir(exist_ok=True)
    RECORDING.write_text(dump(recording))


if __name__ == "__main__":
    main(sys.argv[1])
