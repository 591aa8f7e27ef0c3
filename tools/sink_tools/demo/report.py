"""What ``staging-sink demo`` observed, how it is judged, and the summary table it prints."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sink.contract.records import WORKER_CAPTURE_FAILED_REASON
from sink.contract.skip_codes import SkipCode
from sink.rollout.assembler import Assembler

__all__ = ("EXPECTED_SKIP", "DemoTally", "live_progress", "percentile", "render_summary", "show_progress")

EXPECTED_SKIP = (SkipCode.ROLLOUT_FAILED, WORKER_CAPTURE_FAILED_REASON)
"""(code, reason) every rollout with an injected capture failure must be skipped with."""
_UI_INTERVAL_S = 0.1
_COUNTER_NAMES = (
    "calls",
    "staged",
    "stage_failures",
    "capture_failures",
    "uncaptured",
    "committed",
    "staged_tokens",
    "rollouts_finished",
)


def percentile(values: Sequence[float], fraction: float) -> float:
    """The *fraction* quantile of *values* (nearest rank); ``nan`` for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


@dataclass
class DemoTally:
    """Counters of one demo run, fed by the worker processes, the assembler and the trainer loop."""

    rollouts: int
    calls_planned: int
    injected: frozenset[str]
    role: str = "all"
    workers: dict[int, dict[str, Any]] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    receipts: int = 0
    verified: dict[str, int] = field(default_factory=dict)
    """Verified rollout id -> tokens in its training row."""
    skipped: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Skipped rollout id -> (code, reason)."""
    record_bytes: int = 0
    memory_peak_bytes: int | None = None
    elapsed_s: float = 0.0
    durable: str = "unknown"
    server: str = ""
    namespace: str = ""
    errors: list[str] = field(default_factory=list)

    def total(self, name: str) -> int:
        """The sum of counter *name* over every worker process."""
        return sum(int(counters.get(name, 0)) for counters in self.workers.values())

    @property
    def pulled(self) -> int:
        """Rollouts the trainer loop has seen (verified or skipped)."""
        return len(self.verified) + len(self.skipped)

    def problems(self) -> list[str]:
        """Why the run failed; empty when every trainable rollout verified and only injected ones were skipped."""
        found = list(self.errors)
        if self.total("rollouts_finished") != self.rollouts:
            found.append(f"only {self.total('rollouts_finished')} of {self.rollouts} rollouts finished")
        if self.total("stage_failures"):
            found.append(f"{self.total('stage_failures')} stage call(s) were not durably acknowledged")
        if self.role != "all":
            return found
        unexpected = {
            rid: skip for rid, skip in self.skipped.items() if rid not in self.injected or skip != EXPECTED_SKIP
        }
        found += [
            f"rollout {rid} skipped unexpectedly: {code} ({reason})"
            for rid, (code, reason) in sorted(unexpected.items())
        ]
        found += [
            f"rollout {rid} had an injected failure but verified" for rid in sorted(self.injected & set(self.verified))
        ]
        missing = self.rollouts - self.pulled
        if missing > 0:
            found.append(f"{missing} rollout(s) never reached the trainer")
        return found

    def as_dict(self) -> dict[str, Any]:
        """The summary as JSON-serializable data."""
        p50, p99 = percentile(self.latencies_ms, 0.50), percentile(self.latencies_ms, 0.99)
        return {
            "ok": not self.problems(),
            "problems": self.problems(),
            "role": self.role,
            "server": self.server,
            "namespace": self.namespace,
            "durability": self.durable,
            "rollouts": self.rollouts,
            "rollouts_with_injected_failures": sorted(self.injected),
            "calls_planned": self.calls_planned,
            **{name: self.total(name) for name in _COUNTER_NAMES},
            "stage_latency_ms": {"p50": None if math.isnan(p50) else p50, "p99": None if math.isnan(p99) else p99},
            "durable_confirmations": self.total("staged"),
            "receipts": self.receipts,
            "verified": len(self.verified),
            "verified_tokens": sum(self.verified.values()),
            "skipped": {rid: {"code": code, "reason": reason} for rid, (code, reason) in sorted(self.skipped.items())},
            "record_bytes": self.record_bytes,
            "server_memory_peak_bytes": self.memory_peak_bytes,
            "elapsed_s": round(self.elapsed_s, 3),
        }


def _size(count: int | None) -> str:
    if count is None:
        return "n/a"
    if count < 1024:
        return f"{count} B"
    if count < 1024 * 1024:
        return f"{count / 1024:.1f} KiB"
    return f"{count / (1024 * 1024):.2f} MiB"


def render_summary(console: Console, tally: DemoTally) -> None:
    """Print the summary table and the verdict."""
    table = Table(title="staging-sink demo: summary", title_justify="left", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("server", escape(tally.server))
    table.add_row("durability", tally.durable)
    injected = len(tally.injected)
    table.add_row(
        "rollouts",
        f"{tally.rollouts} ({tally.rollouts - injected} trainable, {injected} with an injected capture failure); "
        f"{tally.total('rollouts_finished')} finished",
    )
    table.add_row(
        "model calls",
        f"{tally.total('calls')} served: {tally.total('staged')} staged, {tally.total('committed')} committed to the "
        f"ledger, {tally.total('capture_failures')} capture failure(s), {tally.total('uncaptured')} served uncaptured",
    )
    table.add_row("tokens staged", f"{tally.total('staged_tokens')}")
    p50, p99 = percentile(tally.latencies_ms, 0.50), percentile(tally.latencies_ms, 0.99)
    latency = "n/a" if math.isnan(p50) else f"p50 {p50:.2f} ms, p99 {p99:.2f} ms ({len(tally.latencies_ms)} stages)"
    table.add_row("stage latency", latency)
    table.add_row(
        "durable confirmations",
        f"{tally.total('staged')} stage(s) acknowledged after a verified fsync; {tally.total('stage_failures')} refused",
    )
    if tally.role == "all":
        table.add_row(
            "bytes in Redis",
            f"{_size(tally.record_bytes)} of staged records; server memory peak {_size(tally.memory_peak_bytes)}",
        )
        table.add_row("receipts", str(tally.receipts))
        verified_tokens = sum(tally.verified.values())
        table.add_row("training rows", f"[green]{len(tally.verified)} verified[/] ({verified_tokens} tokens)")
        reasons = Counter(tally.skipped.values())
        skipped = ", ".join(
            escape(f"{count} × {code} ({reason})") + (" (injected)" if (code, reason) == EXPECTED_SKIP else "")
            for (code, reason), count in sorted(reasons.items())
        )
        table.add_row("skipped rollouts", f"{len(tally.skipped)} skipped" + (f": {skipped}" if skipped else ""))
    table.add_row("wall time", f"{tally.elapsed_s:.2f} s")
    console.print(table)
    problems = tally.problems()
    if not problems:
        verdict = (
            "every trainable rollout verified; only the injected failures were skipped"
            if tally.role == "all"
            else "every rollout staged durably and finished"
        )
        console.print(f"[bold green]OK[/]: {verdict}")
    for problem in problems:
        console.print(f"[bold red]FAILED[/]: {escape(problem)}")


@contextmanager
def live_progress(tally: DemoTally, console: Console) -> Iterator[Progress]:
    """Live progress bars on *console* (a terminal; nothing otherwise), removed when the block ends."""
    progress = Progress(
        TextColumn("{task.description:<26}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        auto_refresh=False,
        disable=not console.is_terminal,
    )
    progress.add_task("model calls served", total=tally.calls_planned, note="")
    progress.add_task("rollouts finished", total=tally.rollouts, note="")
    if tally.role == "all":
        progress.add_task("receipts", total=tally.rollouts, note="")
        progress.add_task("trainer rows", total=tally.rollouts, note="")
    with progress:
        yield progress


async def show_progress(progress: Progress, tally: DemoTally, assembler: Assembler | None, stop: anyio.Event) -> None:
    """Refresh *progress* from *tally* (and the assembler's receipts) every 0.1 s until *stop* is set."""
    while True:
        if assembler is not None:
            tally.receipts = assembler.statistics().published
        task_ids = progress.task_ids
        progress.update(task_ids[0], completed=tally.total("calls"), note=f"{tally.total('staged')} staged durably")
        progress.update(task_ids[1], completed=tally.total("rollouts_finished"), note="")
        if len(task_ids) > 2:
            progress.update(task_ids[2], completed=tally.receipts, note="")
            progress.update(
                task_ids[3],
                completed=tally.pulled,
                note=f"{len(tally.verified)} verified, {len(tally.skipped)} skipped",
            )
        progress.refresh()
        if stop.is_set():
            return
        with anyio.move_on_after(_UI_INTERVAL_S):
            await stop.wait()
