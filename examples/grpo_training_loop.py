"""A GRPO-style training loop on staging-sink, with numpy only (no framework).

Each step pulls whole groups (all rollouts of one prompt, ``finished(..., group_id=, group_size=)``), packs
them into bins of ``--max-tokens``, computes a group-normalized advantage per rollout
((reward - group mean) / (group std + eps)), a policy-gradient loss over the generated tokens, acknowledges the
rollouts it trained (after the "optimizer step") and prints one line.

It ends by itself: after ``--max-steps`` steps, or when no new group came for ``--idle-timeout-s`` seconds
(default 60: raise it for agents whose rollouts take longer). It acknowledges only what it trained and says,
when it happens, what it sets aside; nothing is discarded:

* a group with a row longer than ``--max-tokens`` is not trained (its advantage needs every member): one line
  names the group, the row and its length; it stays unacknowledged: raise ``--max-tokens`` and run again;
* a group still waiting for members (fewer finished than its ``group_size``) is held by the assemblers, not by
  this rank: it is published when the rest arrive, or partial after the assemblers' ``group_timeout_s`` (600 s;
  a partial group is trained on the members that arrived, and said so; ``AssemblerStatistics.groups_waiting``
  counts the groups waiting);
* when the loop ends, groups pulled but not trained and overlong ones are listed; they stay
  unacknowledged: the next run with the same consumer name (``grpo-rank-0``) gets them back at once, another
  rank after ``claim_idle_ms``.

``--max-tokens`` defaults to 32768, the context length of common open models: one row holds a whole rollout,
every turn's prompt, tool output and generated tokens, so a multi-turn agent rollout runs to thousands of tokens
(a bin that size costs a few hundred kB per array).

    python examples/grpo_training_loop.py                      # a private durable server and simulated rollouts
    python examples/grpo_training_loop.py --redis-url URL --no-simulate   # train on what your workers produce
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence

import anyio
import numpy as np
import redis.asyncio as redis

from sink import Assembler, AsyncRedisStagingSink, CaptureGate, RedisCaptureLedger, finished
from sink.server import DurableServer
from sink.settings import ReaderSettings
from sink.trainer.groups import RolloutGroup
from sink.trainer.packing import pack
from sink.trainer.reader.sync_reader import SyncRolloutReader
from worker import RolloutTokenCapture

EPS = 1e-6


async def simulate(url: str, groups: int, group_size: int, seed: int = 0) -> None:
    """Produce *groups* prompts x *group_size* scored rollouts (one model call each) and their receipts."""
    rng = random.Random(seed)
    async with AsyncRedisStagingSink.from_url(url) as sink, RedisCaptureLedger.from_url(url) as ledger:
        gate, capture = CaptureGate(ledger), RolloutTokenCapture(sink=sink, weight_version_fn=lambda: 3)
        async with redis.Redis.from_url(url) as client:
            for g in range(groups):
                prompt = [rng.randrange(1000) for _ in range(rng.randrange(4, 12))]
                for m in range(group_size):
                    rollout_id = f"prompt-{g}-sample-{m}"
                    request = [{"role": "user", "content": f"prompt {g}"}]
                    generated = [rng.randrange(1000) for _ in range(rng.randrange(2, 24))]
                    admission = await gate.admit(rollout_id, request)
                    assert admission is not None  # a fresh rollout is always admitted
                    call = await capture.abegin_call(admission)
                    coords = await capture.acomplete_call(
                        call,
                        prompt_token_ids=prompt,
                        generated_token_ids=generated,
                        generated_logprobs=[-rng.random() * 3 for _ in generated],
                    )
                    response = [{"role": "assistant", "content": f"answer {m}"}]
                    await gate.commit(
                        admission,
                        coords,
                        response_id=f"resp-{rollout_id}",
                        request_items=request,
                        response_items=response,
                    )
                    reward = float(rng.random() < 0.5)
                    await finished(client, rollout_id, reward=reward, group_id=f"prompt-{g}", group_size=group_size)
    published = anyio.Event()
    count = 0

    async def before_ack(_entry: object) -> None:
        nonlocal count
        count += 1
        if count == groups * group_size:
            published.set()

    async with (
        Assembler.from_url(url, block_ms=100, before_ack=before_ack) as assembler,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(assembler.run)  # builds and publishes the receipts
        with anyio.fail_after(60):
            await published.wait()
        assembler.stop()


def grpo_loss(groups: Sequence[RolloutGroup], max_tokens: int) -> tuple[float, int, int, float]:
    """Pack the groups' rows and return (loss, bins, tokens, mean |advantage|) of one policy-gradient step."""
    members = [member for group in groups for member in group.members]
    packed = pack(members, max_tokens=max_tokens)
    advantage_of: dict[str, float] = {}
    for group in groups:
        for member in group.members:
            reward = member.receipt.reward or 0.0
            advantage_of[member.rollout_id] = (reward - group.reward_mean) / (group.reward_std + EPS)
    advantages = np.array([advantage_of[rollout_id] for rollout_id in packed.rollout_ids], dtype=np.float32)
    on_token = packed.segment_ids >= 0
    token_advantage = np.where(on_token, advantages[np.maximum(packed.segment_ids, 0)], 0.0)
    # Without a model, the current policy's log-probs are the behaviour log-probs (ratio 1): the loss is
    # -mean over generated tokens of advantage * log pi(token).
    weights = packed.loss_mask
    loss = -float((token_advantage * packed.generation_logprobs * weights).sum() / max(weights.sum(), 1.0))
    return loss, len(packed.bins), int(packed.input_lengths.sum()), float(np.abs(advantages).mean())


def longest_row(group: RolloutGroup) -> tuple[str, int]:
    """The member with the longest row, and its length in tokens."""
    lengths = [(len(m.row.token_ids) if m.row is not None else 0, m.rollout_id) for m in group.members]
    length, rollout_id = max(lengths, default=(0, ""))
    return rollout_id, length


def train(
    url: str, *, max_steps: int, groups_per_step: int, max_tokens: int, idle_timeout_s: float, block_ms: int = 200
) -> list[str]:
    """Run up to *max_steps* training steps, or until no new group came for *idle_timeout_s*; return the printed
    lines."""
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    settings = ReaderSettings(consumer_name="grpo-rank-0")
    with SyncRolloutReader.from_url(url, settings) as reader:
        pending: list[RolloutGroup] = []
        overlong: list[RolloutGroup] = []
        step, last_group_at = 0, time.monotonic()
        while step < max_steps:
            if len(pending) < groups_per_step:
                pulled = reader.pull_groups(16, block_ms=block_ms)
                if pulled:
                    last_group_at = time.monotonic()
                for group in pulled:
                    rollout_id, length = longest_row(group)
                    arrived = f"{len(group.members)} of {group.group_size} members"
                    if length > max_tokens:
                        overlong.append(group)
                        what = f"group {group.group_id!r} ({len(group.members)} rollouts): rollout {rollout_id!r}"
                        say(
                            f"set aside {what} has {length} tokens > --max-tokens {max_tokens}; not trained, left "
                            "unacknowledged (raise --max-tokens to train it)"
                        )
                        continue
                    if not group.complete:
                        say(
                            f"group {group.group_id!r} came incomplete after group_timeout_s: {arrived}; training those"
                        )
                    pending.append(group)
                if len(pending) < groups_per_step:
                    if time.monotonic() - last_group_at >= idle_timeout_s:
                        say(f"no new group for {idle_timeout_s:g} s: stopping after {step} of {max_steps} steps")
                        break
                    continue
            batch, pending = pending[:groups_per_step], pending[groups_per_step:]
            loss, bins, tokens, advantage = grpo_loss(batch, max_tokens)
            # ... optimizer.step() here; only then acknowledge (a crash before this re-delivers the groups).
            reader.ack_groups(batch)
            say(
                f"step {step}: groups={len(batch)} rollouts={sum(len(g.members) for g in batch)} bins={bins} "
                f"tokens={tokens} mean_reward={np.mean([g.reward_mean for g in batch]):.3f} "
                f"mean|adv|={advantage:.3f} loss={loss:.4f}"
            )
            step += 1
        left = (
            ("pulled", len(pending), sum(len(g.members) for g in pending)),
            (f"overlong (a row > --max-tokens {max_tokens})", len(overlong), sum(len(g.members) for g in overlong)),
        )
        for what, groups, rollouts in left:
            if groups:
                say(
                    f"left {groups} {what} group{'s' if groups != 1 else ''} ({rollouts} rollouts) unacknowledged: "
                    "redelivered to the next run of this rank, or to another rank after claim_idle_ms"
                )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="a durable server (default: start a private one)")
    parser.add_argument("--no-simulate", action="store_true", help="do not produce simulated rollouts first")
    parser.add_argument("--max-steps", "--steps", type=int, default=3, help="stop after this many steps")
    parser.add_argument(
        "--idle-timeout-s", type=float, default=60.0, help="stop when no new group came for this many seconds"
    )
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4, help="of the simulated groups")
    parser.add_argument("--max-tokens", type=int, default=32768, help="the bin width; longer rows are set aside")
    args = parser.parse_args(argv)

    def run(url: str) -> None:
        if not args.no_simulate:
            anyio.run(simulate, url, args.max_steps * args.groups_per_step, args.group_size)
        train(
            url,
            max_steps=args.max_steps,
            groups_per_step=args.groups_per_step,
            max_tokens=args.max_tokens,
            idle_timeout_s=args.idle_timeout_s,
        )

    if args.redis_url:
        run(args.redis_url)
    else:
        with DurableServer() as server:
            run(server.url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
