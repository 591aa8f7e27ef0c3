"""Exact-prefix mode in the in-process middleware (``--middleware worker.proxy.in_process.EnvCaptureMiddleware``):
the wrapped app itself is probed on the first request, and a drifting engine's re-templated history never reaches a
continuation's prompt. A ``nemo-rl`` upstream is never probed (it honours ``required_prefix_token_ids`` itself)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import anyio
import pytest

from sink.settings import ProxySettings
from sink_tools.simulated.http_app import DRIFT_SPACE_ID, EngineApp
from sink_tools.simulated.options import EngineOptions
from tests.helpers.proxy import close_clients, expected_ids, finish, pull, run_agent
from worker.errors import StagingModeError
from worker.proxy.app import ProxyApp
from worker.proxy.in_process import EnvCaptureMiddleware, config_from_environment
from worker.proxy.serve import running_server


@pytest.fixture(autouse=True)
def _clients() -> Iterator[None]:
    yield
    close_clients()


@pytest.mark.parametrize("mode", ["auto", "verify"])
def test_in_process_exact_mode_defeats_drift(redis_url: str, mode: str, caplog: pytest.LogCaptureFixture) -> None:
    env = {"STAGING_SINK_REDIS_URL": redis_url, "STAGING_SINK_PREFIX_MODE": mode}
    engine = EngineApp(EngineOptions(seed=23, drift=True, scale_out=True))
    rollout_id = f"inproc-exact-{mode}"
    with caplog.at_level(logging.INFO, logger="worker.proxy"), running_server(EnvCaptureMiddleware(engine, env)) as url:
        conversation, last_id = run_agent([url], rollout_id, turns=3)
        finish(url, rollout_id, 1.0, last_id)
    [pulled] = pull(redis_url, 1)
    if mode == "verify":  # the engine re-templates history with drift: the continuation is not staged
        assert pulled.row is None and pulled.receipt.capture_poisoned
        return
    assert "prefix mode: exact" in caplog.text
    assert pulled.row is not None and len(pulled.row.model_call_ids) == 3
    assert DRIFT_SPACE_ID not in pulled.row.token_ids
    assert list(pulled.row.token_ids) == expected_ids(EngineApp(), conversation)


def test_prefix_mode_from_the_environment(redis_url: str) -> None:
    assert config_from_environment({"STAGING_SINK_REDIS_URL": redis_url}).prefix_mode == "auto"
    with pytest.raises(ValueError, match="PREFIX_MODE"):
        config_from_environment({"STAGING_SINK_REDIS_URL": redis_url, "STAGING_SINK_PREFIX_MODE": "fast"})


def test_nemo_rl_is_not_probed(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    engine = EngineApp(EngineOptions(seed=24, scale_out=True, honour_prefix=True))
    with running_server(engine) as url:
        settings = ProxySettings(upstream_url=url, redis_url=redis_url, upstream_kind="nemo-rl")
        with caplog.at_level(logging.INFO, logger="worker.proxy"), running_server(ProxyApp(settings)) as proxy:
            run_agent([proxy], "nemo-rl-exact", turns=2)
        assert "prefix mode: required_prefix_token_ids" in caplog.text
        refused = ProxyApp(settings.model_copy(update={"weight_source": "engine"}))
        with pytest.raises(StagingModeError, match="nemo-rl"):
            anyio.run(refused.open)
