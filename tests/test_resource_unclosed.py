"""A forgotten ``close()`` never hangs the process (real Valkey 8 / Redis 7.0 servers).

Each script runs in a subprocess with a deadline: it opens a synchronous facade, uses it and ends
without closing it (normally, or by raising before its ``finally``). The process must exit on its
own, and an unclosed facade is reported with a ``ResourceWarning`` (shown with ``-W always``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

DEADLINE_S = 20.0
ROOT = Path(__file__).resolve().parents[1]

_SINK = """
from sink.store.sink import RedisStagingSink
from tests.helpers.staging import make_record
sink = RedisStagingSink.from_url({url!r})
assert sink.stage(make_record("unclosed", "c0")).ok
"""
_SOURCE = """
from sink.store.source import RedisStagingSource
source = RedisStagingSource.from_url({url!r})
print(source.fetch([]))
"""
_RAISES = """
from sink.store.sink import RedisStagingSink
sink = RedisStagingSink.from_url({url!r})
raise SystemExit("training step failed before the finally")
"""
_DROPPED = """
import gc
from sink.store.sink import RedisStagingSink
RedisStagingSink.from_url({url!r})
gc.collect()
print("collected")
"""


def _run(script: str, url: str) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(script).format(url=url)
    return subprocess.run(
        [sys.executable, "-W", "always::ResourceWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
        cwd=ROOT,
    )


@pytest.mark.parametrize("script", [_SINK, _SOURCE], ids=["sink", "source"])
def test_a_script_that_never_closes_exits_and_warns(redis_url: str, script: str) -> None:
    done = _run(script, redis_url)
    assert done.returncode == 0, done.stderr
    assert "ResourceWarning" in done.stderr and "unclosed" in done.stderr, done.stderr


def test_a_script_that_raises_before_its_finally_still_exits(redis_url: str) -> None:
    done = _run(_RAISES, redis_url)
    assert done.returncode == 1 and "training step failed" in done.stderr, done.stderr


def test_a_dropped_facade_warns_when_collected(redis_url: str) -> None:
    done = _run(_DROPPED, redis_url)
    assert done.returncode == 0 and done.stdout.strip() == "collected", done.stderr
    assert "ResourceWarning" in done.stderr and "RedisStagingSink" in done.stderr, done.stderr
