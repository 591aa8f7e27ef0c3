"""The engine an exact-mode test runs on, in either tier: the simulated one (fast tier) or a real vLLM 0.32 of one
tiny-model variant (``vllm`` tier), with the ids the tests bias."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field

import pytest

from sink_tools.simulated.engine import IM_END
from sink_tools.simulated.http_app import EngineApp
from sink_tools.simulated.options import EngineOptions
from tests.helpers.vllm_server import VllmServer
from worker.proxy.serve import running_server

__all__ = ("TierEngine", "tier_engine")

_HIDDEN = ("<|endoftext|>", "<|im_start|>", "<think>")


@dataclass(frozen=True)
class TierEngine:
    """An engine under test: its URL, served model, end-of-turn id and the ids the tests bias."""

    url: str
    model: str
    eot: int
    hidden: tuple[int, ...] = ()
    """Ids the tiny model must not sample (specials its text would hide)."""
    think_end: int | None = None
    letters: dict[str, int] = field(default_factory=dict)
    """Ids of single characters ``a``, ``e`` and ``o`` (the tiny tokenizers have no merges)."""

    def bias(self, **by_id: float) -> dict[str, float]:
        """A ``logit_bias`` keeping the hidden ids out, plus *by_id* (id as text -> bias)."""
        out = {str(token): -100.0 for token in self.hidden}
        out.update(by_id)
        return out


def tier_engine(kind: str, variant: str, request: pytest.FixtureRequest, stack: ExitStack, *, seed: int = 5) -> TierEngine:
    """The simulated engine (served in *stack*) for ``kind="simulated"``, else the running vLLM of *variant*."""
    if kind == "simulated":
        app = EngineApp(EngineOptions(seed=seed, scale_out=True, max_model_len=1024))
        letters = {letter: app.engine.tokenizer.encode(letter)[0] for letter in "aeo"}
        return TierEngine(stack.enter_context(running_server(app)), "simulated", IM_END, letters=letters)
    server: VllmServer = request.getfixturevalue(f"vllm_{variant}")
    hidden = tuple(server.id_of(token) for token in _HIDDEN)
    think_end = server.id_of("</think>") if variant == "reasoning" else None
    letters = {letter: server.id_of(letter) for letter in "aeo"}
    return TierEngine(server.url, server.model, server.id_of("<|im_end|>"), hidden, think_end, letters)
