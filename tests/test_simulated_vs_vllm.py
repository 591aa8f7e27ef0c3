"""The simulated engine answers as vLLM 0.32 does: the same requests, the same shapes, omissions and defaults.

``tests/data/vllm_shapes.json`` records, per case of :mod:`tests.helpers.vllm_shapes`, what the real vLLM 0.32 answers
on its chat, render, generate and derender routes, reduced to shapes (key sets, null versus absent, types, the sampling
fields render keeps, counts, finish and stop reasons). The fast tier runs every case on the simulated engine (one
per model variant: ChatML, a reasoning parser, tool calls) and requires the recorded shapes; the ``vllm`` tier runs
them on the live servers and requires the same, so a vLLM that changes its answers fails here until the recording is
regenerated (``.venv/bin/python -m tests.helpers.vllm_shapes DIR``, with ``DIR`` a ``STAGING_SINK_VLLM_REUSE``
folder). Streams are compared by the shapes of their chunks, not their number, and a live vLLM may merge chunks
(see ``_matches``): how many tokens a chunk carries depends on the machine's load.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

import pytest

from sink_tools.simulated.http_app import EngineApp
from sink_tools.simulated.options import EngineOptions
from tests.helpers.vllm_server import VllmServer
from tests.helpers.vllm_shapes import CASES, MAX_MODEL_LEN, RECORDING, Case, ShapeEngine, run_case
from worker.proxy.serve import running_server

_RECORDED: dict[str, Any] = json.loads(RECORDING.read_text())["cases"]
_SIMULATED = {
    "chatml": EngineOptions(seed=7, scale_out=True, max_model_len=MAX_MODEL_LEN),
    "reasoning": EngineOptions(seed=7, scale_out=True, max_model_len=MAX_MODEL_LEN, reasoning_field="reasoning"),
    "tools": EngineOptions(seed=7, scale_out=True, max_model_len=MAX_MODEL_LEN),
}


def _answers(kind: str, case: Case, request: pytest.FixtureRequest) -> dict[str, Any]:
    if kind == "vllm":
        server: VllmServer = request.getfixturevalue(f"vllm_{case.variant}")
        return run_case(case, ShapeEngine(server.url, server.model))
    with running_server(EngineApp(_SIMULATED[case.variant])) as url:
        return run_case(case, ShapeEngine(url, "simulated"))


def _matches(kind: str, recorded: dict[str, Any], answer: dict[str, Any]) -> bool:
    """*answer* has the *recorded* shape. A live vLLM's stream may skip recorded chunk shapes but never add one or
    change the last: a reader that fell behind (a busy machine) gets every token not taken yet in one chunk, so the
    chunks that carry the first tokens can merge into a later one (:func:`tests.helpers.vllm_shapes.stream_shape`)."""
    if answer == recorded:
        return True
    if kind != "vllm" or "stream" not in recorded or "stream" not in answer or not answer["stream"]:
        return False
    got, want = answer["stream"], recorded["stream"]
    rest = {k: v for k, v in answer.items() if k != "stream"} == {k: v for k, v in recorded.items() if k != "stream"}
    return rest and got[-1] == want[-1] and _in_order(got, want)


def _in_order(got: list[Any], want: list[Any]) -> bool:
    """Every item of *got* is in *want*, in *want*'s order."""
    remaining = iter(want)
    return all(any(item == candidate for candidate in remaining) for item in got)


def test_a_live_stream_may_merge_chunks_but_not_add_or_change_them() -> None:
    first, middle, last = ({"delta": kind} for kind in ("role", "token", "finish"))
    recorded = {"status": 200, "stream": [first, middle, last]}
    assert _matches("vllm", recorded, {"status": 200, "stream": [first, last]})
    assert _matches("vllm", recorded, {"status": 200, "stream": [first, middle, last]})
    assert not _matches("simulated", recorded, {"status": 200, "stream": [first, last]})
    assert not _matches("vllm", recorded, {"status": 200, "stream": [first, middle]})
    assert not _matches("vllm", recorded, {"status": 200, "stream": [middle, first, last]})
    assert not _matches("vllm", recorded, {"status": 200, "stream": [first, {"delta": "new"}, last]})
    assert not _matches("vllm", recorded, {"status": 400, "stream": [first, last]})


def test_the_recording_covers_every_case() -> None:
    assert sorted(_RECORDED) == sorted(case.name for case in CASES)


@pytest.mark.parametrize("kind", ["simulated", pytest.param("vllm", marks=pytest.mark.vllm)])
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_the_engine_answers_the_recorded_shapes(kind: str, case: Case, request: pytest.FixtureRequest) -> None:
    answers = _answers(kind, case, request)
    recorded = _RECORDED[case.name]
    assert sorted(answers) == sorted(recorded)
    for step, shape in recorded.items():
        if not _matches(kind, shape, answers[step]):
            want, got = (
                json.dumps(x, indent=1, sort_keys=True, ensure_ascii=False).splitlines() for x in (shape, answers[step])
            )
            diff = "\n".join(difflib.unified_diff(want, got, "vLLM 0.32", kind, lineterm="", n=2))
            pytest.fail(f"{case.name}/{step} differs from what vLLM 0.32 answered:\n{diff}")
