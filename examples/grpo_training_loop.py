"""A GRPO-style training loop on staging-sink, with numpy only (no framework).

Each step pulls whole groups (all rollouts of one prompt, ``finished(..., group_id=, group_size=)``), packs
them into bins of ``--max-tokens``, computes a group-normalized advantage per rollout
((reward - group mean) / (group std + eps)), a policy-gradient loss over the generated tokens, acknowledges the
rollouts it trained (after the "optimizer step") and prints one line.

It acknowledges only what it trained. The rest is never discarded:

* groups pulled but not trained when the loop ends stay unacknowledged: the next run with the same consumer name
  (``grpo-rank-0``) gets them back at once, another rank after ``claim_idle_ms``;
* a group with a row longer than ``--max-tokens`` is not trained (its advantage needs every member) and stays
  unacknowledged, reported on one line: raise ``--max-tokens`` (or split such rows) and run again.

    python examples/grpo_training_loop.py                      # a private durable server and simulated rollouts
    python examples/grpo_training_loop.py --redis-url URL --no-simulate   # train on what your workers produce
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence

import anyio
import numpy as np
import redis.asyncio as redis

from sink import Assembler, AsyncRedisStagingSink, CaptureGate, RedisCaptureLedger, finished
from sink.server import durable_server
from sink.trainer.groups import RolloutGroup
from sink.trainer.packing import pack
from sink.trainer.sync_reader import SyncRolloutReader
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


def fits(group: RolloutGroup, max_tokens: int) -> bool:
    """Whether every member's row fits one bin (a longer row is never truncated: the group is not trained)."""
    return all(member.row is None or len(member.row.token_ids) <= max_tokens for member in group.members)


def train(url: str, *, steps: int, groups_per_step: int, max_tokens: int, block_ms: int = 200) -> list[str]:
    """Run *steps* training steps; return the printed lines."""
    lines: list[str] = []
    with SyncRolloutReader.from_url(url, consumer_name="grpo-rank-0") as reader:
        pending: list[RolloutGroup] = []
        overlong: list[RolloutGroup] = []
        for step in range(steps):
            while len(pending) < groups_per_step:
                pulled = reader.pull_groups(16, block_ms=block_ms)
                overlong += [group for group in pulled if not fits(group, max_tokens)]
                pending += [group for group in pulled if fits(group, max_tokens)]
            batch, pending = pending[:groups_per_step], pending[groups_per_step:]
            loss, bins, tokens, advantage = grpo_loss(batch, max_tokens)
            # ... optimizer.step() here; only then acknowledge (a crash before this re-delivers the groups).
            reader.ack_groups(batch)
            line = (
                f"step {step}: groups={len(batch)} rollouts={sum(len(g.members) for g in batch)} bins={bins} "
                f"tokens={tokens} mean_reward={np.mean([g.reward_mean for g in batch]):.3f} "
                f"mean|adv|={advantage:.3f} loss={loss:.4f}"
            )
            print(line)
            lines.append(line)
        for what, groups in (("pulled", pending), (f"overlong (a row > --max-tokens {max_tokens})", overlong)):
            if groups:
                line = (
                    f"left {len(groups)} {what} group{'s' if len(groups) != 1 else ''} "
                    f"({sum(len(g.members) for g in groups)} rollouts) unacknowledged: redelivered to the next "
                    "run of this rank, or to another rank after claim_idle_ms"
                )
                print(line)
                lines.append(line)
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="a durable server (default: start a private one)")
    parser.add_argument("--no-simulate", action="store_true", help="do not produce simulated rollouts first")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    def run(url: str) -> None:
        if not args.no_simulate:
            anyio.run(simulate, url, args.steps * args.groups_per_step, args.group_size)
        train(url, steps=args.steps, groups_per_step=args.groups_per_step, max_tokens=args.max_tokens)

    if args.redis_url:
        run(args.redis_url)
    else:
        with durable_server() as server:
            run(server.url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
