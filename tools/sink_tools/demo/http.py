"""``staging-sink demo --http``: the simulated RL step over the real HTTP path.

Agents are HTTP clients (httpx) of the capture proxy (uvicorn), which fronts the simulated engine served over HTTP
with vLLM's response JSON (uvicorn). Every rollout is a multi-turn chat with tool results; some turns are retried
(the first attempt becomes a childless sibling). A few rollouts have their history edited by the agent on purpose
(an earlier assistant message rewritten): that continuation cannot resolve its parent, the gate writes
``unresolved_parent`` and the rollout must come back skipped. The harness ends each rollout with
``POST /r/{rollout_id}/finished``; this process runs the assembler and a trainer reader that pulls and verifies
every rollout. Exit status 0 only if every unedited rollout verified and every edited one was skipped.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import httpx

from sink.keys import DEFAULT_NAMESPACE
from sink.rollout.assembler import Assembler
from sink.server import DurableServer
from sink.settings import ProxySettings
from sink.trainer.reader.rollout_reader import RolloutReader
from sink_tools.simulated.http_app import EngineApp
from sink_tools.simulated.options import EngineOptions
from worker.proxy.app import ProxyApp
from worker.proxy.serve import running_server

__all__ = ("HttpDemoResult", "http_demo_command", "run_http_demo")

_PATH = (
    "HTTP: httpx agents -> capture proxy (uvicorn, exact-prefix mode) -> simulated engine over HTTP (uvicorn, vLLM JSON "
    "and token-in/token-out routes)"
)


@dataclass
class HttpDemoResult:
    """What the HTTP demo did."""

    rollouts: int
    edited: set[str]
    verified: set[str] = field(default_factory=set)
    skipped: dict[str, str] = field(default_factory=dict)
    tokens: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Every unedited rollout verified and every edited one was skipped."""
        return set(self.skipped) == self.edited and len(self.verified) == self.rollouts - len(self.edited)

    def summary(self) -> str:
        """Human-readable summary lines."""
        reasons = sorted(set(self.skipped.values()))
        return "\n".join(
            [
                f"path: {_PATH}",
                (
                    f"rollouts: {self.rollouts}; verified by the trainer: {len(self.verified)} ({self.tokens} tokens); "
                    f"skipped: {len(self.skipped)} (edited on purpose: {len(self.edited)}; reasons: {', '.join(reasons)})"
                ),
                f"proxy calls: {self.counts}",
                f"elapsed: {self.seconds:.1f} s; result: {'OK' if self.ok else 'FAILED'}",
            ]
        )


async def _rollout(
    http: httpx.AsyncClient, base: str, rollout_id: str, turns: int, tokens: int, rng: random.Random, edit: bool
) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful agent. Use tools."},
        {"role": "user", "content": f"Task {rollout_id}: summarise the data."},
    ]
    url = f"{base}/r/{rollout_id}/v1/chat/completions"
    last_id = ""
    edit_turn = rng.randrange(1, turns) if edit and turns > 1 else -1
    for turn in range(turns):
        if turn == edit_turn:
            messages[2] = {**messages[2], "content": messages[2]["content"] + " (edited by the agent)"}
        body = {"model": "simulated", "messages": messages, "max_tokens": tokens, "min_tokens": 2}
        attempts = 2 if rng.random() < 0.15 else 1
        for _ in range(attempts):
            answer = await http.post(url, json=body)
            answer.raise_for_status()
        payload = answer.json()
        last_id = payload["id"]
        messages.append({"role": "assistant", "content": payload["choices"][0]["message"]["content"]})
        messages.append(
            {"role": "tool", "tool_call_id": f"t{turn}", "content": f"result {turn}: {rng.randrange(99)} rows"}
        )
    finished = await http.post(
        f"{base}/r/{rollout_id}/finished", json={"reward": round(rng.random(), 3), "declared_response_id": last_id}
    )
    finished.raise_for_status()


@dataclass(frozen=True)
class _Plan:
    turns: int
    tokens: int
    edited: int
    seed: int
    concurrency: int
    run_id: str


async def _step(url: str, namespace: str, base: str, result: HttpDemoResult, plan: _Plan) -> None:
    rng = random.Random(plan.seed)
    ids = [f"demo-http-{plan.run_id}-{index:04d}" for index in range(result.rollouts)]
    edited = set(rng.sample(ids, min(plan.edited, len(ids))))
    result.edited = edited
    turns, tokens, concurrency = plan.turns, plan.tokens, plan.concurrency
    limit = anyio.Semaphore(concurrency)

    async def one(rollout_id: str, seed_value: int) -> None:
        async with limit:
            await _rollout(http, base, rollout_id, turns, tokens, random.Random(seed_value), rollout_id in edited)

    async with httpx.AsyncClient(timeout=60) as http, anyio.create_task_group() as group:
        for rollout_id in ids:
            group.start_soon(one, rollout_id, rng.randrange(2**31))
    async with (
        Assembler.from_url(url, namespace=namespace, block_ms=100) as assembler,
        RolloutReader.from_url(url, namespace=namespace) as reader,
        anyio.create_task_group() as group,
    ):
        group.start_soon(assembler.run)
        with anyio.fail_after(120):
            while len(result.verified) + len(result.skipped) < result.rollouts:
                for pulled in await reader.pull(32, block_ms=200):
                    if pulled.rows:  # one row, or one per chain of a multi-chain rollout
                        result.verified.add(pulled.rollout_id)
                        result.tokens += sum(len(row.token_ids) for row in pulled.rows)
                    else:
                        result.skipped[pulled.rollout_id] = pulled.skip_reason or pulled.skip_code or "?"
                    await reader.ack([pulled.rollout_id])
        assembler.stop()


def run_http_demo(
    *,
    redis_url: str | None = None,
    namespace: str | None = None,
    rollouts: int = 12,
    turns: int = 4,
    tokens: int = 32,
    edited: int = 2,
    seed: int = 0,
    concurrency: int = 8,
    run_id: str = "run",
) -> HttpDemoResult:
    """Run the HTTP demo on *redis_url* (or a private durable server) and return what happened."""
    result = HttpDemoResult(rollouts, set())
    plan = _Plan(turns, tokens, edited, seed, concurrency, run_id)
    started = time.monotonic()

    def run(url: str) -> None:
        ns = namespace or DEFAULT_NAMESPACE
        with running_server(EngineApp(EngineOptions(seed=seed, scale_out=True))) as engine_url:
            proxy = ProxyApp(ProxySettings(upstream_url=engine_url, redis_url=url, namespace=ns))
            with running_server(proxy) as base:
                anyio.run(partial(_step, url, ns, base, result, plan))
        result.counts = dict(proxy.metrics.counts)

    if redis_url:
        run(redis_url)
    else:
        with DurableServer() as server:
            run(server.url)
    result.seconds = time.monotonic() - started
    return result


def http_demo_command(args: argparse.Namespace) -> int:
    """``staging-sink demo --http``: the demo's options mapped onto :func:`run_http_demo`; exit 0 only if OK."""
    run_id = secrets.token_hex(3)
    namespace = args.namespace or (f"demo-http-{run_id}" if args.redis_url else None)
    outcome = run_http_demo(
        redis_url=args.redis_url,
        namespace=namespace,
        rollouts=args.rollouts,
        turns=args.turns,
        tokens=args.tokens,
        edited=args.inject_failures,
        seed=args.seed,
        concurrency=args.concurrency,
        run_id=run_id,
    )
    if args.json:
        document = {
            "path": _PATH,
            "rollouts": outcome.rollouts,
            "verified": len(outcome.verified),
            "skipped": outcome.skipped,
            "tokens": outcome.tokens,
            "proxy_calls": outcome.counts,
            "ok": outcome.ok,
        }
        sys.stdout.write(json.dumps(document, sort_keys=True) + "\n")
    else:
        sys.stdout.write(outcome.summary() + "\n")
    return 0 if outcome.ok else 1
