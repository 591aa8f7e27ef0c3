"""A PyTorch data pipeline over the synchronous reader: an ``IterableDataset`` of verified, staged batches.

Optional: ``pip install 'staging-sink[torch] @ git+<repo>'`` (or ``pip install -e '.[torch]'`` in a clone).
Nothing else in :mod:`sink` imports torch; this module does, on import.

:class:`StagedRolloutDataset` yields one :class:`TorchBatch` per pull: the pulled rollouts collated
(:func:`~sink.trainer.batch.collate`, ``[B, T]``) or packed (:func:`~sink.trainer.packing.pack`,
``[N, max_tokens]``), every array handed over with ``torch.from_numpy`` (no copy). Use it with automatic
batching off and, with workers, batches as they come,
``DataLoader(dataset, batch_size=None, num_workers=N, in_order=False)``: each batch is already a batch, and in
torch's default order a batch one worker has ready waits for the next batch of the worker before it, which has
none while no receipt comes (at the end of a run: never).

Rank-aware: every reading process has its own consumer name in the ``trainers`` group,
``<prefix>-rank<R>-worker<W>`` (``R`` from ``torch.distributed`` when it is initialized, else ``$RANK``, else 0;
``W`` the ``DataLoader`` worker id, ``main`` without workers), so ranks and workers never share a lease.

Acknowledgement is explicit, never at iteration: call :meth:`StagedRolloutDataset.ack` with a batch after the
optimizer step. It returns once the batch's rollouts are acknowledged, with or without workers: with workers the
ids go to the worker that read the batch (the reader that holds them, one queue per worker), whose acknowledging
thread applies them at once (after the worker's pull in progress: at most ``block_ms`` when it waits for
receipts) and answers; that thread also renews the worker's leases while the worker waits for the loader.

Nothing waits in one worker's hand while another has nothing: a pull reads no more receipts than it returns, and
what a wait brought beyond that goes back to the group at once
(:meth:`~sink.trainer.reader.rollout_reader.RolloutReader.release_unpulled`), taken by the next reader about to wait. So every
rollout is yielded promptly, by one worker, and not as a double delivery. One epoch is ``max_batches`` batches
per reading process (``None``: endless). A worker that has produced its last batch waits (renewing its leases)
up to ``ack_wait_s`` for the acknowledgements of its batches still in flight; a reader that stops with rollouts
in hand (the loop broken off, ``ack_wait_s`` over) gives them back
(:meth:`~sink.trainer.reader.rollout_reader.RolloutReader.release_held`): the next reader takes them at once, as double
deliveries (they may have been trained). A batch never acknowledged is delivered again. A worker waiting for
receipts when the loop is broken off does not see torch's request to stop: torch waits 5 s for each such worker,
then terminates it, and the worker still gives back what it holds before it exits.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.queues
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

try:
    import torch
    import torch.distributed
    from torch.utils.data import IterableDataset, get_worker_info
except ImportError as exc:  # pragma: no cover - the torch extra is installed in CI
    raise ImportError(
        "sink.trainer.torch_data needs PyTorch, an optional extra: pip install -e '.[torch]' in a clone"
    ) from exc

from sink.errors import BatchInputError
from sink.settings import ReaderSettings
from sink.trainer.batch import OverlongRow, SkippedRollout, collate
from sink.trainer.packing import pack
from sink.trainer.pulled import PulledRollout
from sink.trainer.reader.sync_reader import (
    RENEWALS_PER_IDLE,
    STOPPED,
    Answer,
    Request,
    SyncRolloutReader,
    WorkerAcks,
    give_back,
)

__all__ = ("BatchMode", "StagedRolloutDataset", "TorchBatch", "distributed_rank")

BatchMode = Literal["collate", "pack"]
_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, eq=False)
class TorchBatch:
    """One batch as tensors, and what to acknowledge after the optimizer step.

    ``tensors``: collated ``input_ids``, ``attention_mask``, ``loss_mask``, ``generation_logprobs``,
    ``policy_mask`` (``[B, T]``), ``input_lengths``, ``rewards``, ``provenance_known`` (``[B]``),
    ``weight_versions`` (``[B, 2]``); packed ``input_ids``, ``position_ids``, ``segment_ids``, ``loss_mask``,
    ``generation_logprobs``, ``policy_mask`` (``[N, max_tokens]``) and the same per-row tensors, with
    ``cu_seqlens`` per bin.
    ``ack_ids``: every rollout the batch came from (rows, ``overlong``, ``skipped``).
    ``worker_id``: the ``DataLoader`` worker that read it (``None``: the loading process); ``iteration``: that
    worker's pass over the dataset (where :meth:`StagedRolloutDataset.ack` sends the ids).
    """

    tensors: dict[str, torch.Tensor]
    cu_seqlens: tuple[torch.Tensor, ...]
    rollout_ids: tuple[str, ...]
    ack_ids: tuple[str, ...]
    overlong: tuple[OverlongRow, ...]
    skipped: tuple[SkippedRollout, ...]
    consumer_name: str
    worker_id: int | None
    iteration: str | None = None

    @property
    def size(self) -> int:
        """Rows in the batch (0 when every pulled rollout was skipped or overlong: acknowledge it anyway)."""
        return len(self.rollout_ids)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __repr__(self) -> str:
        return (
            f"<TorchBatch rows={self.size} consumer={self.consumer_name!r} overlong={len(self.overlong)} "
            f"skipped={len(self.skipped)}>"
        )


def distributed_rank() -> int:
    """This process's rank: ``torch.distributed`` when initialized, else ``$RANK``, else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    text = os.environ.get("RANK", "0")
    if not text.isdigit():
        raise BatchInputError(f"RANK must be a non-negative integer, got {text!r}")
    return int(text)


def _positive(name: str, value: object) -> int:
    if type(value) is not int or value < 1:
        raise BatchInputError(f"{name} must be an int >= 1, got {value!r}")
    return value


class _Termination:
    """SIGTERM in a ``DataLoader`` worker during its pass over the dataset (the handler installed for the pass).

    torch stops its workers by asking each and joining it for 5 s, then terminates those still running: a worker
    waiting for receipts inside the dataset never sees the request, so it gets SIGTERM (torch's own handler would
    end it at once, its rollouts in hand kept until ``claim_idle_ms``). While the dataset's own code runs (a pull,
    giving back), a SIGTERM is noted and the worker stops at the next check (a pull returns within ``block_ms``):
    what it read is known, and it gives back what it holds before it exits. Where stopping at once loses nothing
    (:meth:`interruptible`: handing a batch to torch, waiting for the last acknowledgements) it exits at once,
    its rollouts given back on the way out. A worker that is a thread (only a process's main thread may set a
    handler) reads without one.
    """

    def __init__(self) -> None:
        self.requested = False
        self.exit_code = 0
        self._interruptible = False
        self._installed = threading.current_thread() is threading.main_thread()
        self._previous = signal.signal(signal.SIGTERM, self._on_signal) if self._installed else None

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.requested, self.exit_code = True, 128 + signum
        if self._interruptible:
            raise SystemExit(self.exit_code)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A SIGTERM in this block (or noted before it) ends the worker at once, with :class:`SystemExit`."""
        if self.requested:
            raise SystemExit(self.exit_code)
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def restore(self) -> None:
        """Put back the handler the worker had (the default where it was not set from Python)."""
        if self._installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)


class StagedRolloutDataset(IterableDataset[TorchBatch]):
    """Batches of staged rollouts from the ``trainers`` group, as tensors (see the module docstring).

    :param url: the Redis/Valkey URL.
    :param rollouts_per_batch: rollouts pulled per batch (a pull that returns fewer makes a smaller batch).
    :param mode: ``"collate"`` (padded ``[B, T]``) or ``"pack"`` (bins of ``max_tokens``, required then).
    :param max_tokens: rows longer than this go to ``overlong`` (never truncated).
    :param num_workers: the ``DataLoader``'s ``num_workers`` (one acknowledgement queue per worker).
    :param max_batches: stop after this many batches per reading process (one epoch; ``None``: never stop).
    :param ack_wait_s: how long a worker that produced its last batch waits for the acknowledgements of the
        batches in flight, and how long :meth:`ack` waits for a worker's answer.
    :param settings: reader settings; ``consumer_name`` is replaced by the rank-aware name.
    :param multiprocessing_context: the ``DataLoader``'s context (the queues must come from the same one).
    :raises BatchInputError: an option out of range.
    """

    def __init__(
        self,
        url: str,
        *,
        rollouts_per_batch: int = 8,
        mode: BatchMode = "collate",
        max_tokens: int | None = None,
        pad_token_id: int = 0,
        pad_to_multiple_of: int = 1,
        consumer_prefix: str = "torch",
        rank: int | None = None,
        num_workers: int = 0,
        max_batches: int | None = None,
        block_ms: int = 1000,
        ack_wait_s: float = 60.0,
        settings: ReaderSettings | None = None,
        multiprocessing_context: str | multiprocessing.context.BaseContext | None = None,
    ) -> None:
        super().__init__()
        _positive("rollouts_per_batch", rollouts_per_batch)
        if mode not in ("collate", "pack"):
            raise BatchInputError(f"mode must be 'collate' or 'pack', got {mode!r}")
        if mode == "pack" and max_tokens is None:
            raise BatchInputError("mode='pack' needs max_tokens (the bin width)")
        if max_batches is not None:
            _positive("max_batches", max_batches)
        if type(num_workers) is not int or num_workers < 0:
            raise BatchInputError(f"num_workers must be an int >= 0, got {num_workers!r}")
        if not ack_wait_s > 0:
            raise BatchInputError(f"ack_wait_s must be > 0, got {ack_wait_s!r}")
        self.url = url
        self.rollouts_per_batch = rollouts_per_batch
        self.mode: BatchMode = mode
        self.max_tokens = max_tokens
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.consumer_prefix = consumer_prefix
        self.rank = rank
        self.max_batches = max_batches
        self.block_ms = block_ms
        self.ack_wait_s = ack_wait_s
        self.settings = settings or ReaderSettings()
        self.consumer_name(0)  # validates the prefix now, not in a worker
        context = (
            multiprocessing.get_context(multiprocessing_context)
            if multiprocessing_context is None or isinstance(multiprocessing_context, str)
            else multiprocessing_context
        )
        self._ack_queues: list[multiprocessing.queues.Queue[Request]] = [context.Queue() for _ in range(num_workers)]
        self._ack_answers: list[multiprocessing.queues.Queue[Answer]] = [context.Queue() for _ in range(num_workers)]
        self._reader: SyncRolloutReader | None = None
        # The loading process's side of the workers' acknowledgements (see ack()).
        self._ack_lock: threading.Lock | None = threading.Lock()
        self._ack_requests = 0
        self._stopped: set[str] = set()  # worker iterations known to have stopped

    def consumer_name(self, worker_id: int | None) -> str:
        """The consumer name of *worker_id* (``None``: no worker) on this rank."""
        rank = distributed_rank() if self.rank is None else self.rank
        worker = "main" if worker_id is None else str(worker_id)
        name = f"{self.consumer_prefix}-rank{rank}-worker{worker}"
        ReaderSettings.model_validate({**self.settings.model_dump(), "consumer_name": name})
        return name

    def ack(self, batch: TorchBatch) -> None:
        """Acknowledge *batch* (call after the optimizer step); returns once its rollouts are acknowledged, at once
        without workers, else by the worker that read it (the batch's ids go through that worker's queue).

        :raises BatchInputError: the batch's reader is closed or its worker stopped (the batch is delivered
            again), or the worker did not answer within ``ack_wait_s``.
        :raises StagingConnectionError: the acknowledgement failed (calling again is safe).
        """
        ids = list(batch.ack_ids)
        if batch.worker_id is None:
            if self._reader is None:
                raise BatchInputError(f"batch of {batch.consumer_name!r} came from a reader that is closed")
            lost = self._reader.ack(ids).lost_lease
        else:
            lost = self._ack_through_worker(batch, ids)
        if lost:
            _log.warning("lost the lease of %d rollout(s) before ack: %s", len(lost), lost)

    def _ack_through_worker(self, batch: TorchBatch, ids: list[str]) -> list[str]:
        worker = batch.worker_id
        assert worker is not None and self._ack_lock is not None
        if worker >= len(self._ack_queues):
            raise BatchInputError(f"batch from worker {worker}, but the dataset has {len(self._ack_queues)}")
        stopped = BatchInputError(
            f"DataLoader worker {worker} ({batch.consumer_name}) stopped before this batch was acknowledged: "
            "it gave its rollouts back, and they are delivered again"
        )
        with self._ack_lock:
            if batch.iteration in self._stopped:
                raise stopped
            self._ack_requests += 1
            number = self._ack_requests
            self._ack_queues[worker].put((str(batch.iteration), number, ids))
            deadline = time.monotonic() + self.ack_wait_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    iteration, answered, lost, error = self._ack_answers[worker].get(timeout=left)
                except queue.Empty:
                    break
                if answered == STOPPED:
                    self._stopped.add(iteration)
                    if iteration == batch.iteration:
                        raise stopped
                elif answered == number:
                    if error is not None:
                        raise error
                    return lost
                # else: the answer to an earlier request that was given up on
        raise BatchInputError(
            f"DataLoader worker {worker} ({batch.consumer_name}) did not answer within ack_wait_s={self.ack_wait_s}"
        )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_reader"] = None  # a worker opens its own reader
        state["_ack_lock"] = None  # the loading process's alone
        return state

    def __iter__(self) -> Iterator[TorchBatch]:
        info = get_worker_info()
        worker_id = None if info is None else int(info.id)
        if worker_id is not None and worker_id >= len(self._ack_queues):
            raise BatchInputError(
                f"DataLoader worker {worker_id} but StagedRolloutDataset(num_workers={len(self._ack_queues)}): "
                "pass the DataLoader's num_workers to the dataset"
            )
        name = self.consumer_name(worker_id)
        settings = ReaderSettings.model_validate({**self.settings.model_dump(), "consumer_name": name})
        with SyncRolloutReader.from_url(self.url, settings) as reader:
            if worker_id is None:
                self._reader = reader
                try:
                    yield from self._batches(reader, name, None, None)
                finally:
                    self._reader = None
                    give_back(reader)
                return
            acks = WorkerAcks(
                reader,
                self._ack_queues[worker_id],
                self._ack_answers[worker_id],
                renew_every_s=self.settings.claim_idle_ms / RENEWALS_PER_IDLE / 1000,
            )
            termination = _Termination()
            try:
                for batch in self._batches(reader, name, worker_id, acks.iteration, termination):
                    acks.expect(batch.ack_ids)
                    with termination.interruptible():
                        yield batch
                with termination.interruptible():  # the batches still in flight
                    unacknowledged = acks.wait_for_all(self.ack_wait_s)
                if unacknowledged:
                    _log.warning(
                        "%s: %d rollout(s) not acknowledged within ack_wait_s=%s: given back, they are delivered "
                        "again",
                        name,
                        len(unacknowledged),
                        self.ack_wait_s,
                    )
            finally:
                acks.stop()
                give_back(reader)
                termination.restore()
            if termination.requested:
                raise SystemExit(termination.exit_code)

    def _batches(
        self,
        reader: SyncRolloutReader,
        name: str,
        worker_id: int | None,
        iteration: str | None,
        termination: _Termination | None = None,
    ) -> Iterator[TorchBatch]:
        produced = 0
        while self.max_batches is None or produced < self.max_batches:
            pulled = reader.pull(self.rollouts_per_batch, block_ms=self.block_ms)
            reader.release_unpulled()  # what the pull read beyond this batch: to whichever reader is free
            if termination is not None and termination.requested:
                return  # what it pulled is held: given back
            if not pulled:
                continue
            yield self._tensors(pulled, name, worker_id, iteration)
            produced += 1

    def _tensors(
        self, pulled: list[PulledRollout], name: str, worker_id: int | None, iteration: str | None
    ) -> TorchBatch:
        if self.mode == "pack":
            assert self.max_tokens is not None
            packed = pack(pulled, max_tokens=self.max_tokens, pad_token_id=self.pad_token_id)
            arrays = {
                "input_ids": packed.input_ids,
                "position_ids": packed.position_ids,
                "segment_ids": packed.segment_ids,
                "loss_mask": packed.loss_mask,
                "generation_logprobs": packed.generation_logprobs,
                "policy_mask": packed.policy_mask,
                "input_lengths": packed.input_lengths,
                "rewards": packed.rewards,
                "weight_versions": packed.weight_versions,
                "provenance_known": packed.provenance_known,
            }
            cu_seqlens = tuple(torch.from_numpy(c) for c in packed.cu_seqlens)
            result: Any = packed
        else:
            result = collate(
                pulled,
                pad_token_id=self.pad_token_id,
                pad_to_multiple_of=self.pad_to_multiple_of,
                max_tokens=self.max_tokens,
            )
            arrays = result.tensors()
            cu_seqlens = ()
        return TorchBatch(
            tensors={key: torch.from_numpy(array) for key, array in arrays.items()},
            cu_seqlens=cu_seqlens,
            rollout_ids=result.rollout_ids,
            ack_ids=result.ack_ids,
            overlong=result.overlong,
            skipped=result.skipped,
            consumer_name=name,
            worker_id=worker_id,
            iteration=iteration,
        )
