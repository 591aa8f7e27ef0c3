"""The report of ``staging-sink bench proxy``: per-path results, best of the repeats, and the target checks.

Every figure of a (path, clients) pair is taken from the best of its repeats: latencies from the repeat with the
lowest p50, throughput the highest calls/s. The proxy's own share of a captured call is measured inside the proxy
(its ``Server-Timing`` header, :mod:`worker.proxy.call_timing`): the call's time in the proxy minus the wall time
spent waiting for engine answers, so it holds the admission, the stage, the ledger commit, the JSON work and any
wait for the proxy's event loop, and never the engine's cost of generating or computing log-probs.

With rLLM's model gateway installed, its two modes are peer paths (``gateway``: traces written to SQLite after
the reply; ``gateway-sync``: its ``sync_traces``, written before it), and the report checks ours against them:
verify mode's added p50 over direct at 1 client at most the gateway's, exact mode's at most ``gateway-sync``'s,
and both capturing proxies' calls/s at 16 clients at least each gateway mode's.

With ``--turns N`` (N >= 2) every call of a client's rollout continues the previous one, and each captured call's
own share is also recorded under its turn (1: the rollout's root call, text mode; 2 and later: continuations). For
each captured path, at the lowest client count run, the report gives the own p50 at turn 1, turn 2 and turn N
(each turn's figure the best repeat's) and checks turn N's against turn 1's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = (
    "GATEWAY_PATHS",
    "MAX_EXACT_TO_VERIFY",
    "MAX_LAST_TURN_TO_FIRST",
    "MIN_CAPTURE_TO_BARE",
    "MIN_CAPTURE_TO_GATEWAY",
    "MIN_EXACT_TO_BARE",
    "OWN_SHARE_OVER_STAGE_MS",
    "PathResult",
    "format_report",
)

MIN_CAPTURE_TO_BARE = 0.6
"""Target: the capturing proxy's (verify mode's) calls/s at 16 clients at least this fraction of bare forwarding's."""
MIN_EXACT_TO_BARE = 0.5
"""Target: exact-prefix mode's calls/s at 16 clients at least this fraction of bare forwarding's."""
MAX_EXACT_TO_VERIFY = 1.3
"""Target: exact-prefix mode's added p50 over calling the engine directly at most this many times verify mode's."""
OWN_SHARE_OVER_STAGE_MS = 1.0
"""Target: the proxy's own share of a captured call (p50) at most the sink's stage p50 plus this many ms."""
MAX_LAST_TURN_TO_FIRST = 1.2
"""Target (``--turns N``, N >= 2): the proxy's own share p50 at turn N at most this many times turn 1's, per mode."""
MIN_CAPTURE_TO_GATEWAY = 1.0
"""Target: a capturing proxy's calls/s at 16 clients at least this fraction of each rLLM gateway mode's."""
GATEWAY_PATHS = ("gateway", "gateway-sync")
"""rLLM's model gateway: traces persisted after the reply (its default), and before it (``sync_traces``)."""
_PEERS = (("verify", "capture", "gateway"), ("exact", "exact", "gateway-sync"))
"""(our mode, its path, the gateway path it is held against) for the added-latency targets."""
_MIN_TO_BARE = {"capture": MIN_CAPTURE_TO_BARE, "exact": MIN_EXACT_TO_BARE}
"""Per captured path, its minimum calls/s at 16 clients as a fraction of bare forwarding's."""
_TURN_KIND = {1: " (root)", 2: " (continuation)"}
"""What the first two turns of a rollout are, said in the per-turn line (turn 1 in text mode, the rest continue)."""


def _percentile_ms(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))] if ordered else float("nan")


@dataclass(frozen=True)
class PathResult:
    """One path at one concurrency, in one repeat."""

    path: str
    clients: int
    calls: int
    seconds: float
    latencies_s: list[float]
    errors: int = 0
    engine_s: list[float] = field(default_factory=list)
    """Per call, the proxy's wait for engine answers (from its ``Server-Timing`` header; captured paths only)."""
    own_s: list[float] = field(default_factory=list)
    """Per call, the proxy's own share: its time on the call minus ``engine_s`` (captured paths only)."""
    capture_s: list[float] = field(default_factory=list)
    """Per call, the stage and the ledger commit (part of ``own_s``; captured paths only)."""
    own_turns: list[int] = field(default_factory=list)
    """Per entry of ``own_s``, the call's turn in its rollout (1: the root call; empty when not recorded)."""

    @property
    def calls_per_s(self) -> float:
        """Throughput."""
        return self.calls / self.seconds

    def percentile_ms(self, q: float) -> float:
        """Latency percentile *q* (0-100) in ms."""
        return _percentile_ms(self.latencies_s, q)

    def own_ms(self, q: float) -> float:
        """The proxy's own share, percentile *q*, in ms (``nan`` without timings)."""
        return _percentile_ms(self.own_s, q)

    def engine_ms(self, q: float) -> float:
        """The proxy's wait for the engine, percentile *q*, in ms (``nan`` without timings)."""
        return _percentile_ms(self.engine_s, q)

    def turn_own_s(self, turn: int) -> list[float]:
        """The own shares of the calls at *turn* of their rollouts (empty without per-turn timings)."""
        return [own for own, at in zip(self.own_s, self.own_turns, strict=False) if at == turn]


@dataclass(frozen=True)
class _Best:
    latency: PathResult
    """The repeat with the lowest p50 (its p50, p99 and timings are reported)."""
    calls_per_s: float
    """The highest throughput of the repeats."""
    runs: tuple[PathResult, ...]
    """Every repeat (the per-turn figures take each turn's best)."""

    @property
    def repeats(self) -> int:
        """How many repeats ran."""
        return len(self.runs)

    def turn_own_p50_ms(self, turn: int) -> tuple[float, int]:
        """The lowest own p50 at *turn* over the repeats, and that repeat's calls at the turn (``nan``, 0: none)."""
        figures = [(_percentile_ms(shares, 50), len(shares)) for run in self.runs if (shares := run.turn_own_s(turn))]
        return min(figures, default=(float("nan"), 0))


def _best(results: Sequence[PathResult]) -> dict[tuple[str, int], _Best]:
    groups: dict[tuple[str, int], list[PathResult]] = {}
    for result in results:
        groups.setdefault((result.path, result.clients), []).append(result)
    return {
        key: _Best(min(runs, key=lambda r: r.percentile_ms(50)), max(r.calls_per_s for r in runs), tuple(runs))
        for key, runs in groups.items()
    }


def _verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def _own_lines(best: dict[tuple[str, int], _Best], stage_p50_ms: float) -> list[str]:
    lines = []
    limit = stage_p50_ms + OWN_SHARE_OVER_STAGE_MS
    for (path, clients), entry in sorted(best.items(), key=lambda item: (item[0][1], item[0][0])):
        run = entry.latency
        if not run.own_s:
            continue
        own = run.own_ms(50)
        lines.append(
            f"proxy's own share, {path} at {clients} clients: p50 {own:.2f} / p99 {run.own_ms(99):.2f} ms "
            f"(stage + commit p50 {_percentile_ms(run.capture_s, 50):.2f} ms, engine wait p50 {run.engine_ms(50):.2f} ms; target p50 <= stage p50 + {OWN_SHARE_OVER_STAGE_MS:g} "
            f"= {limit:.2f} ms: {_verdict(own <= limit)})"
        )
    return lines


def _turn_lines(best: dict[tuple[str, int], _Best], turns: int) -> list[str]:
    """Per captured path, at its lowest client count with per-turn timings: the own p50 at turn 1 (the root call),
    turn 2 (the first continuation) and turn *turns*, and turn *turns*' against turn 1's."""
    lines = []
    for path in ("capture", "exact"):
        counts = sorted(
            clients for (name, clients), entry in best.items() if name == path and any(r.own_turns for r in entry.runs)
        )
        if not counts:
            continue
        entry, clients = best[(path, counts[0])], counts[0]
        shown = sorted({1, 2, turns})
        figures = {turn: entry.turn_own_p50_ms(turn) for turn in shown}
        described = ", ".join(
            f"turn {turn}{_TURN_KIND.get(turn, '')} {p50:.2f} ms ({calls} call{'' if calls == 1 else 's'})"
            for turn, (p50, calls) in figures.items()
        )
        first, last = figures[1][0], figures[turns][0]
        ratio = last / first if first > 0 else float("nan")
        lines.append(f"proxy's own share p50 by turn, {path} at {clients} clients: {described}")
        lines.append(
            f"{path} own p50 at turn {turns} / turn 1 at {clients} clients: {ratio:.2f} "
            f"(target own p50 at turn {turns} <= {MAX_LAST_TURN_TO_FIRST:g}x turn 1's: "
            f"{_verdict(ratio <= MAX_LAST_TURN_TO_FIRST)})"
        )
    return lines


def _gateway_lines(best: dict[tuple[str, int], _Best]) -> list[str]:
    """Ours against rLLM's gateway: added p50 over direct at 1 client, calls/s at 16 clients."""
    lines = []
    for mode, path, peer in _PEERS:
        keys = [("direct", 1), (path, 1), (peer, 1)]
        if all(key in best for key in keys):
            direct, ours, theirs = (best[key].latency.percentile_ms(50) for key in keys)
            added, peer_added = ours - direct, theirs - direct
            lines.append(
                f"{mode} vs {peer}, added p50 over direct at 1 client: {added:.2f} vs {peer_added:.2f} ms "
                f"(target {mode} <= {peer}: {_verdict(added <= peer_added)})"
            )
    for path in ("capture", "exact"):
        for peer in GATEWAY_PATHS:
            if (path, 16) in best and (peer, 16) in best and best[(peer, 16)].calls_per_s > 0:
                ratio = best[(path, 16)].calls_per_s / best[(peer, 16)].calls_per_s
                verdict = _verdict(ratio >= MIN_CAPTURE_TO_GATEWAY)
                lines.append(
                    f"{path}/{peer} calls/s at 16 clients: {ratio:.2f} (target >= {MIN_CAPTURE_TO_GATEWAY:g}: {verdict})"
                )
    return lines


def format_report(
    results: list[PathResult],
    stage_p50_ms: float,
    tokens: int,
    engine: str = "",
    notes: Sequence[str] = (),
    *,
    turns: int = 1,
) -> str:
    """The side-by-side table (best of the repeats) and the target checks; *notes* are lines after the engine's
    (the gateway paths skipped, or their traces counted). With *turns* >= 2 (the rollouts' length), the captured
    paths' own share at turn 1, 2 and *turns*, and its target."""
    best = _best(results)
    repeats = max((entry.repeats for entry in best.values()), default=0)
    width = max([8, *(len(path) for path, _ in best)])  # "gateway-sync" widens the path column
    title = f"proxy benchmark: {tokens}-token chat completions; sink stage p50 {stage_p50_ms:.2f} ms"
    heading = f"{'clients':>7} {'path':>{width}} {'calls':>6} {'errors':>6} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8}"
    lines = [
        f"{title}; best of {repeats} interleaved repeat(s)",
        *([f"engine: {engine}"] if engine else []),
        *notes,
        f"{heading} {'own p50':>8} {'own p99':>8}",
    ]
    for (path, clients), entry in best.items():
        run = entry.latency
        own = f" {run.own_ms(50):>8.2f} {run.own_ms(99):>8.2f}" if run.own_s else ""
        lines.append(
            f"{clients:>7} {path:>{width}} {run.calls:>6} {run.errors:>6} {entry.calls_per_s:>9.1f} "
            f"{run.percentile_ms(50):>8.2f} {run.percentile_ms(99):>8.2f}{own}"
        )
    for path in ("capture", "exact"):
        if (path, 16) in best and ("bare", 16) in best and best[("bare", 16)].calls_per_s > 0:
            ratio, limit = best[(path, 16)].calls_per_s / best[("bare", 16)].calls_per_s, _MIN_TO_BARE[path]
            lines.append(
                f"{path}/bare calls/s at 16 clients: {ratio:.2f} (target >= {limit:g}: {_verdict(ratio >= limit)})"
            )
    if ("capture", 1) in best and ("bare", 1) in best:
        added = best[("capture", 1)].latency.percentile_ms(50) - best[("bare", 1)].latency.percentile_ms(50)
        verdict = _verdict(added <= stage_p50_ms + 1)
        lines.append(f"added p50 at 1 client: {added:.2f} ms (target <= {stage_p50_ms + 1:.2f} ms: {verdict})")
    lines.extend(_own_lines(best, stage_p50_ms))
    if turns >= 2:
        lines.extend(_turn_lines(best, turns))
    for clients in sorted({clients for _, clients in best}):
        keys = [("direct", clients), ("capture", clients), ("exact", clients)]
        if all(key in best for key in keys):
            direct, verify, exact = (best[key].latency for key in keys)
            verify_p50, verify_p99, exact_p50, exact_p99 = (
                path.percentile_ms(q) - direct.percentile_ms(q) for path in (verify, exact) for q in (50, 99)
            )
            ratio = exact_p50 / verify_p50 if verify_p50 > 0 else float("inf")
            lines.append(
                f"added over direct at {clients} clients: verify p50 {verify_p50:.2f} / p99 {verify_p99:.2f} ms, "
                f"exact p50 {exact_p50:.2f} / p99 {exact_p99:.2f} ms; exact/verify p50 {ratio:.2f} "
                f"(target <= {MAX_EXACT_TO_VERIFY:g}: {_verdict(ratio <= MAX_EXACT_TO_VERIFY)})"
            )
    lines.extend(_gateway_lines(best))
    return "\n".join(lines)
