"""The staged-data report as one self-contained HTML page (inline CSS and SVG, no script, no external request).

:func:`render_report` takes plain views (built by :mod:`sink_cli.report` from what is stored) and returns the
page: a namespace summary (rollouts by state, tokens staged per minute, skip reasons) and, per rollout, its
receipt, verification status and calls; per call the prompt (carried, mask 0) and generated (mask 1) token
spans, the mask, a log-prob sparkline, the weight version and the chain link to the parent call.
Every value is escaped; element classes and ids are stable (tests and scrapers rely on them).
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ("CallView", "RolloutView", "SummaryView", "render_report", "sparkline_svg")

MAX_TOKENS_SHOWN = 400
"""Tokens shown per call; the rest are counted, not drawn."""


@dataclass(frozen=True, slots=True)
class CallView:
    """One staged call: its delta columns and where it links in the chain."""

    model_call_id: str
    parent_call_id: str | None
    prev_len: int
    cum_len: int
    weight_version: int
    digest: str
    token_ids: Sequence[int]
    token_mask: Sequence[float]
    logprobs: Sequence[float]
    link: str
    """``root``, ``ok`` (prev_len equals the parent's cum_len) or a reason the link is broken."""
    status: str
    """``digest ok`` when the record was fetched and verified, else why not (``missing``, ``corrupt: ...``)."""


@dataclass(frozen=True, slots=True)
class RolloutView:
    rollout_id: str
    state: str
    verification: str
    """``verified``, ``consumed``, ``not verified: <code>: <detail>`` or ``no receipt``."""
    reward: float | None
    terminal_call_id: str | None
    calls: Sequence[CallView]


@dataclass(frozen=True, slots=True)
class SummaryView:
    namespace: str
    server: str
    generated_at: str
    rollouts_by_state: Mapping[str, int]
    tokens_per_minute: Sequence[tuple[str, int]]
    """(``HH:MM`` UTC, tokens staged in that minute), oldest first."""
    skip_reasons: Mapping[str, int]
    notes: Sequence[str] = field(default_factory=tuple)


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1b1f23;background:#fff}
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
.tok{display:inline-block;font:12px monospace;padding:0 2px;margin:1px;border-radius:2px}
.tok.prompt{background:#dbe9ff}.tok.gen{background:#d4f5d4;font-weight:bold}
.status.ok{color:#137333;font-weight:bold}.status.bad{color:#b3261e;font-weight:bold}
.legend span{margin-right:12px}.mask{font:12px monospace;word-break:break-all;color:#555}
.call{border:1px solid #ddd;border-radius:4px;padding:8px;margin:8px 0}
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _ok_class(text: str) -> str:
    return "ok" if text in ("verified", "consumed", "digest ok", "ok", "root") else "bad"


def sparkline_svg(values: Sequence[float], *, width: int = 240, height: int = 36) -> str:
    """An inline SVG polyline of *values* (log-probs), scaled to the box; an empty box for no values."""
    if not values:
        return f'<svg class="sparkline empty" width="{width}" height="{height}" role="img"></svg>'
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    step = width / max(len(values) - 1, 1)
    points = " ".join(
        f"{i * step:.1f},{(height - 2) - (v - low) / span * (height - 4):.1f}" for i, v in enumerate(values)
    )
    return (
        f'<svg class="sparkline" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">'
        f"<title>log-probs of {len(values)} generated tokens, min {low:.3f}, max {high:.3f}</title>"
        f'<rect width="{width}" height="{height}" fill="#f6f8fa"/>'
        f'<polyline fill="none" stroke="#c2410c" stroke-width="2" points="{points}"/></svg>'
    )


def _bars_svg(series: Sequence[tuple[str, int]], *, width: int = 480, height: int = 80) -> str:
    if not series:
        return '<p class="empty">no staged records in the calls streams</p>'
    top = max(value for _, value in series) or 1
    bar = min(width / len(series), 24.0)
    rects = "".join(
        f'<rect x="{i * bar:.1f}" y="{height - value / top * height:.1f}" width="{max(bar - 2, 1):.1f}" '
        f'height="{value / top * height:.1f}" fill="#0b57d0"><title>{_e(label)}: {value} tokens</title></rect>'
        for i, (label, value) in enumerate(series)
    )
    return f'<svg class="tokens-per-minute" width="{width}" height="{height}" role="img">{rects}</svg>'


def _table(caption: str, klass: str, rows: Sequence[tuple[object, object]], headers: tuple[str, str]) -> str:
    body = "".join(f"<tr><td>{_e(a)}</td><td>{_e(b)}</td></tr>" for a, b in rows) or (
        '<tr><td colspan="2">none</td></tr>'
    )
    return (
        f'<table class="{klass}"><caption>{_e(caption)}</caption>'
        f"<tr><th>{_e(headers[0])}</th><th>{_e(headers[1])}</th></tr>{body}</table>"
    )


def _summary(summary: SummaryView) -> str:
    return (
        '<section id="summary"><h2>Namespace summary</h2>'
        f"<p>namespace <b>{_e(summary.namespace)}</b> at {_e(summary.server)}, {_e(summary.generated_at)}</p>"
        + _table("rollouts by state", "by-state", sorted(summary.rollouts_by_state.items()), ("state", "rollouts"))
        + "<h3>Tokens staged per minute (UTC)</h3>"
        + _bars_svg(summary.tokens_per_minute)
        + _table("tokens per minute", "per-minute", summary.tokens_per_minute, ("minute", "tokens"))
        + _table("skip reasons", "skip-reasons", sorted(summary.skip_reasons.items()), ("code", "rollouts"))
        + "".join(f'<p class="note">{_e(note)}</p>' for note in summary.notes)
        + "</section>"
    )


def _tokens(call: CallView) -> str:
    spans = []
    for token, mask in list(zip(call.token_ids, call.token_mask, strict=True))[:MAX_TOKENS_SHOWN]:
        kind = "gen" if mask == 1.0 else "prompt"
        spans.append(f'<span class="tok {kind}">{_e(token)}</span>')
    hidden = len(call.token_ids) - MAX_TOKENS_SHOWN
    more = f'<span class="more">… {hidden} more</span>' if hidden > 0 else ""
    return f'<div class="tokens">{"".join(spans)}{more}</div>'


def _call(call: CallView) -> str:
    generated = [lp for lp, mask in zip(call.logprobs, call.token_mask, strict=True) if mask == 1.0]
    prompt = sum(1 for mask in call.token_mask if mask != 1.0)
    mask_text = "".join("1" if mask == 1.0 else "0" for mask in call.token_mask[:MAX_TOKENS_SHOWN])
    return (
        f'<div class="call" data-call="{_e(call.model_call_id)}">'
        f"<h4>call {_e(call.model_call_id)}</h4>"
        "<table class=\"call-facts\">"
        f"<tr><th>parent</th><td>{_e(call.parent_call_id or '-')}</td>"
        f'<th>chain link</th><td class="link status {_ok_class(call.link)}">{_e(call.link)}</td></tr>'
        f"<tr><th>prev_len → cum_len</th><td>{call.prev_len} → {call.cum_len}</td>"
        f'<th>weight version</th><td class="weight-version">{call.weight_version}</td></tr>'
        f"<tr><th>prompt / generated tokens</th><td>{prompt} / {len(generated)}</td>"
        f'<th>record</th><td class="record status {_ok_class(call.status)}">{_e(call.status)}</td></tr>'
        f"<tr><th>digest</th><td colspan=\"3\"><code>{_e(call.digest)}</code></td></tr></table>"
        f"{_tokens(call)}"
        f'<div class="mask" title="loss mask">mask {mask_text}</div>'
        f"<div>log-probs {sparkline_svg(generated)}</div></div>"
    )


def _rollout(view: RolloutView) -> str:
    reward = "-" if view.reward is None else f"{view.reward:g}"
    status = "ok" if view.verification in ("verified", "consumed") else "bad"
    calls = "".join(_call(call) for call in view.calls) or '<p class="empty">no staged records left</p>'
    return (
        f'<section class="rollout" id="rollout-{_e(view.rollout_id)}"><h2>rollout {_e(view.rollout_id)}</h2>'
        f"<p>state <b>{_e(view.state)}</b>; verification "
        f'<span class="verification status {status}">{_e(view.verification)}</span>; reward {_e(reward)}; '
        f"terminal call {_e(view.terminal_call_id or '-')}; {len(view.calls)} staged call(s)</p>"
        '<p class="legend"><span class="tok prompt">prompt (mask 0)</span><span class="tok gen">generated '
        "(mask 1)</span></p>"
        f"{calls}</section>"
    )


def render_report(summary: SummaryView, rollouts: Sequence[RolloutView]) -> str:
    """The whole page."""
    title = f"staging-sink report: {summary.namespace}"
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{_e(title)}</h1>{_summary(summary)}"
        f'<div id="rollouts">{"".join(_rollout(view) for view in rollouts)}</div></body></html>\n'
    )
