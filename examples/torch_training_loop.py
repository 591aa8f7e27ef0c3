"""A PyTorch training loop on staging-sink (the ``torch`` extra): a DataLoader over staged rollouts.

Each batch comes from :class:`sink.trainer.torch_data.StagedRolloutDataset` as tensors (``torch.from_numpy``, no
copy). A tiny policy takes an optimizer step on a REINFORCE-style loss over the generated tokens (the loss mask),
and only then is the batch acknowledged (``dataset.ack(batch)``, which returns once it is, workers or not): a
crash before that re-delivers it. A rollout that cannot be trained (failed, poisoned, stale) is acknowledged with
its batch and said on a line of its own. Each reading process (the main one, or each of ``--workers``) stops
after ``--steps`` batches, so the run ends once ``--steps x --rollouts-per-step x max(--workers, 1)`` rollouts
came (the simulated ones are exactly that many).

    pip install -e '.[torch]'                              # in a clone; CPU build: pip install torch==2.13.0
    python examples/torch_training_loop.py                 # a private durable server and simulated rollouts
    python examples/torch_training_loop.py --redis-url URL --no-simulate --workers 2   # your workers' rollouts
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import anyio
import torch
from grpo_training_loop import simulate  # the sibling example: simulated, scored rollouts and their receipts
from torch.utils.data import DataLoader

from sink.server import DurableServer
from sink.trainer.torch_data import StagedRolloutDataset, TorchBatch

VOCAB = 1000


class TinyPolicy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids % VOCAB))


def policy_loss(model: TinyPolicy, batch: TorchBatch) -> torch.Tensor:
    """-mean over generated tokens of reward * log pi(token | previous token)."""
    ids = batch["input_ids"]
    logp = torch.log_softmax(model(ids[:, :-1]), dim=-1).gather(-1, (ids[:, 1:] % VOCAB).unsqueeze(-1)).squeeze(-1)
    rewards = torch.nan_to_num(batch["rewards"], nan=0.0).unsqueeze(-1)
    mask = batch["loss_mask"][:, 1:]
    return -(rewards * logp * mask).sum() / mask.sum().clamp(min=1.0)


def train(url: str, *, steps: int, rollouts_per_step: int, workers: int) -> list[str]:
    """Run *steps* optimizer steps (per reading process); return the printed lines."""
    dataset = StagedRolloutDataset(
        url, rollouts_per_batch=rollouts_per_step, max_batches=steps, num_workers=workers, block_ms=500
    )
    # Batches as they come: in torch's default order one worker's batch waits for the worker before it in turn.
    loader = DataLoader(dataset, batch_size=None, num_workers=workers, in_order=False)
    torch.manual_seed(0)
    model = TinyPolicy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lines: list[str] = []
    for step, batch in enumerate(loader):
        loss = policy_loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        dataset.ack(batch)  # after the step, explicitly: never at iteration
        line = (
            f"step {step}: rows={batch.size} tokens={int(batch['input_lengths'].sum())} "
            f"consumer={batch.consumer_name} loss={loss.item():.4f}"
        )
        print(line, flush=True)
        lines.append(line)
        for skipped in batch.skipped:
            line = f"set aside rollout {skipped.rollout_id!r}: {skipped.skip_code} ({skipped.skip_reason})"
            print(line, flush=True)
            lines.append(line)
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--redis-url", help="a durable server (default: start a private one)")
    parser.add_argument("--no-simulate", action="store_true", help="do not produce simulated rollouts first")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per reading process")
    parser.add_argument("--rollouts-per-step", type=int, default=4)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    args = parser.parse_args(argv)

    def run(url: str) -> None:
        if not args.no_simulate:
            total = args.steps * args.rollouts_per_step * max(args.workers, 1)
            anyio.run(simulate, url, total, 1)
        train(url, steps=args.steps, rollouts_per_step=args.rollouts_per_step, workers=args.workers)

    if args.redis_url:
        run(args.redis_url)
    else:
        with DurableServer() as server:
            run(server.url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
