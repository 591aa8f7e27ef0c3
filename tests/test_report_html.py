"""``staging-sink report`` / ``inspect R --html``: the page is written from a real server and opened in a real
headless Chromium; its DOM (``--dump-dom``) and its screenshot show the expected elements."""

from __future__ import annotations

import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import anyio
import numpy as np
import pytest
import redis
from PIL import Image

from sink.keys import record_key
from sink_tools.report_html import sparkline_svg
from tests.helpers.e2e import stage_rollouts
from tests.helpers.trainer import publish

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.fail("no chromium on PATH: scripts/test installs it (apt-get install --no-install-recommends chromium)")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sink_cli", *args], capture_output=True, text=True, timeout=60, check=False
    )


def _browser(page: Path, tmp_path: Path, *mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *mode, page.as_uri()],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


class _Elements(HTMLParser):
    """Elements by class and id, and the text inside ``.status`` elements, of a DOM dump."""

    def __init__(self) -> None:
        super().__init__()
        self.classes: list[str] = []
        self.ids: list[str] = []
        self.statuses: list[str] = []
        self._in_status = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        classes = (values.get("class") or "").split()
        self.classes += [f"{tag}.{c}" for c in classes]
        if values.get("id"):
            self.ids.append(f"{tag}#{values['id']}")
        self._in_status = 1 if "status" in classes else 0

    def handle_data(self, data: str) -> None:
        if self._in_status and data.strip():
            self.statuses.append(data.strip())
            self._in_status = 0


@pytest.mark.slow  # starts Chromium twice; the fast tier checks the written page (test_inspect_html_...)
def test_the_report_opens_in_chromium_with_every_expected_element(redis_url: str, tmp_path: Path) -> None:
    staged = anyio.run(lambda: publish(redis_url, ["html-a", "html-b"], calls=3, n_tokens=6))
    anyio.run(lambda: stage_rollouts(redis_url, ["html-live"], calls=2))
    with redis.Redis.from_url(redis_url) as client:  # corrupt html-b's second record: it must not verify
        key = record_key("stg", staged["html-b"].staging_keys[1])
        blob = client.get(key)
        assert isinstance(blob, bytes)
        client.set(key, blob[:-3] + b"\x00\x00\x00")
    page = tmp_path / "report.html"
    result = _cli("report", "html-a", "html-b", "html-live", "--redis-url", redis_url, "--html", str(page))
    assert result.returncode == 0, result.stderr
    assert "wrote the report of 3 rollout(s)" in result.stderr

    dom = _browser(page, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    elements = _Elements()
    elements.feed(dom.stdout)
    assert {"section#summary", "section#rollout-html-a", "section#rollout-html-b", "section#rollout-html-live"} <= set(
        elements.ids
    )
    assert {"table.by-state", "table.per-minute", "table.skip-reasons", "svg.tokens-per-minute"} <= set(
        elements.classes
    )
    assert elements.classes.count("div.call") == 3 + 3 + 2
    assert elements.classes.count("svg.sparkline") == 8 and elements.classes.count("svg.empty") == 1  # corrupt
    assert elements.classes.count("span.gen") > 0 and elements.classes.count("span.prompt") > 0
    assert "verified" in elements.statuses and "no receipt" in elements.statuses
    assert any(s.startswith("not verified: corrupt_record") for s in elements.statuses), elements.statuses
    assert any(s.startswith("corrupt:") for s in elements.statuses)  # the corrupt record itself
    assert elements.statuses.count("root") == 3 and "ok" in elements.statuses  # chain links
    assert "receipt_waiting" in dom.stdout and "staging" in dom.stdout  # rollouts by state
    assert "corrupt_record" in dom.stdout.split('id="rollouts"')[0]  # the skip reasons in the summary

    shot = tmp_path / "shot.png"
    taken = _browser(page, tmp_path, "--window-size=1200,4000", f"--screenshot={shot}")
    assert taken.returncode == 0 and shot.exists(), taken.stderr[-2000:]
    with Image.open(shot) as image:
        pixels = np.frombuffer(image.convert("RGB").tobytes(), dtype=np.uint8).reshape(-1, 3).astype(np.int16)
    counts = {
        name: int((np.abs(pixels - np.array(color, dtype=np.int16)).max(axis=1) <= tolerance).sum())
        for name, color, tolerance in (
            ("generated tokens", (212, 245, 212), 4),
            ("prompt tokens", (219, 233, 255), 4),
            ("sparklines", (194, 65, 12), 40),
            ("verified", (19, 115, 51), 40),
            ("not verified", (179, 38, 30), 40),
            ("per-minute bars", (11, 87, 208), 4),
        )
    }
    assert all(count > 50 for count in counts.values()), counts


def test_inspect_html_writes_one_rollout_and_refuses_an_unknown_one(redis_url: str, tmp_path: Path) -> None:
    anyio.run(lambda: publish(redis_url, ["one-a"], calls=2))
    page = tmp_path / "one.html"
    result = _cli("inspect", "one-a", "--redis-url", redis_url, "--html", str(page))
    assert result.returncode == 0, result.stderr
    text = page.read_text()
    assert 'id="rollout-one-a"' in text and text.count('class="call"') == 2 and "<script" not in text
    missing = _cli("inspect", "no-such", "--redis-url", redis_url, "--html", str(tmp_path / "x.html"))
    assert missing.returncode == 1 and "no such rollout 'no-such'" in missing.stderr
    assert not (tmp_path / "x.html").exists()


def test_the_sparkline_scales_values_into_its_box() -> None:
    svg = sparkline_svg([-3.0, -1.0, 0.0], width=100, height=20)
    points = svg.split('points="')[1].split('"')[0].split()
    xs = [float(p.split(",")[0]) for p in points]
    ys = [float(p.split(",")[1]) for p in points]
    assert xs == [0.0, 50.0, 100.0] and ys[0] == 18.0 and ys[2] == 2.0
    assert "empty" in sparkline_svg([])
