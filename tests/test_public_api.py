"""Public surface: a tuple ``__all__`` in every module, and the seed API of ``sink.contract.records``.

In the spirit of anyio's ``tests/test_all_attributes.py``.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

import sink
import worker
from sink.contract import records
from sink.contract.digest import EMPTY_EXTRAS_DIGEST
from tests.helpers.servers import extra_missing


def _walk_modules() -> list[str]:
    names = []
    for package in (sink, worker):
        names.append(package.__name__)
        walked = pkgutil.walk_packages(package.__path__, prefix=package.__name__ + ".")
        # importing a __main__ module would run the CLI
        names.extend(info.name for info in walked if info.name.rsplit(".", 1)[-1] != "__main__")
    if extra_missing("torch"):  # the torch extra's module: it raises a clear ImportError without torch
        names.remove("sink.trainer.torch_data")
    return sorted(names)


MODULE_NAMES = _walk_modules()


def test_walk_finds_the_core_modules() -> None:
    assert {"sink", "worker", "sink.contract.records", "sink.contract.digest", "sink.errors", "sink.keys"} <= set(
        MODULE_NAMES
    )


@pytest.mark.parametrize("module_name", MODULE_NAMES)
def test_module_all_is_a_complete_tuple(module_name: str) -> None:
    module: ModuleType = importlib.import_module(module_name)
    exported = getattr(module, "__all__", None)
    assert isinstance(exported, tuple), f"{module_name}.__all__ must be a tuple"
    assert len(set(exported)) == len(exported), f"{module_name}.__all__ has duplicates"
    missing = [name for name in exported if not hasattr(module, name)]
    assert not missing, f"{module_name}.__all__ names missing attributes: {missing}"
    unlisted = [
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and getattr(value, "__module__", None) == module_name
        and name not in exported
    ]
    assert not unlisted, f"{module_name} defines public names missing from __all__: {unlisted}"


_OUTSIDE_THE_ROOT = {
    # A redis-py error on purpose: the connection layer translates it like any refusal of the server.
    "sink.store.scripts.runner.LibraryNotLoadedError",
}
"""Public exception classes of the packages that do not descend from :class:`sink.errors.StagingError`."""


def test_every_public_exception_descends_from_the_one_root() -> None:
    outside = set()
    for module_name in MODULE_NAMES:
        if module_name.startswith("sink_tools.simulated"):  # a tool: its errors become HTTP answers, never raised out
            continue
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module_name
                and not name.startswith("_")
                and not issubclass(value, sink.StagingError)
            ):
                outside.add(f"{module_name}.{name}")
    assert outside == _OUTSIDE_THE_ROOT


# --- seed API of nemo_gym.token_id_capture.staging.records ---------------------------

SEED_CLASSES = (
    "CallRecord",
    "CaptureAdmission",
    "CaptureLedgerCommit",
    "CommitCoords",
    "GenerationCutContinuation",
    "ManifestFailure",
    "RolloutManifest",
    "RolloutReceipt",
    "RolloutRemoval",
    "StageResult",
    "StagedCallBaseSnapshot",
    "StagedCallRecord",
    "StagedCallSnapshot",
    "_DigestWireModel",
    "_WireModel",
)
SEED_DATA = (
    "CaptureDisposition",
    "CaptureMode",
    "DigestHex",
    "Identifier",
    "NonNegativeInt",
    "PositiveInt",
    "_BUILD_STAGING_DIGEST",
)
SEED_CONSTANTS = {
    "STAGING_SCHEMA_VERSION": 2,
    "STAGING_DIGEST_VERSION": 2,
    "EXTRAS_DIGEST_VERSION": 1,
    "EMPTY_EXTRAS_DIGEST": "a1edc33c107616cf344faf0103daa025cfb125f8e1c784ae5f6a49faf2b768b6",
    "WORKER_MISSING_COMMIT_COORDS_REASON": "worker_response_missing_commit_coordinates",
    "WORKER_CAPTURE_FAILED_REASON": "worker_capture_failed",
    "INVALID_COMMIT_COORDS_REASON": "invalid_worker_commit_coordinates",
    "UNRESOLVED_PARENT_REASON": "unresolved_parent",
    "UNCOMMITTED_CALL_REASON": "request_finished_without_staged_coordinates",
    "LEDGER_ROW_MISSING_RESPONSE_ID_REASON": "ledger_row_missing_response_id",
    "LEDGER_ROW_MISSING_CHAIN_HASH_REASON": "ledger_row_missing_chain_hash",
    "TERMINAL_SELECTED": "selected",
    "TERMINAL_NO_RECORDS": "no_records",
    "TERMINAL_DUPLICATE_CALL_ID": "duplicate_call_id",
    "TERMINAL_ORPHANED_ROW": "orphaned_row",
    "TERMINAL_NO_ROOT": "no_root",
    "TERMINAL_AMBIGUOUS": "ambiguous_terminal",
}

REQUIRED = object()
LIST: list[Any] = []
VERSIONS = {"schema_version": 2}
DIGEST_VERSIONS = {**VERSIONS, "digest_version": 2, "extras_digest_version": 1}
# Field -> default (REQUIRED when the field has none), copied from the seed API.
BASE_SNAPSHOT_FIELDS = {
    **DIGEST_VERSIONS,
    "chain_hash": REQUIRED,
    "cum_len": REQUIRED,
    "cumulative_hash": REQUIRED,
    "delta_len": REQUIRED,
    "digest": REQUIRED,
    "extras_digest": EMPTY_EXTRAS_DIGEST,
    "generation_log_probs_delta": REQUIRED,
    "mode": REQUIRED,
    "model_call_id": REQUIRED,
    "parent_call_id": None,
    "prev_len": REQUIRED,
    "rollout_id": REQUIRED,
    "token_ids_delta": REQUIRED,
    "token_mask_delta": REQUIRED,
    "weight_version": REQUIRED,
}
SEED_FIELDS: dict[str, dict[str, Any]] = {
    "_WireModel": VERSIONS,
    "_DigestWireModel": DIGEST_VERSIONS,
    "CallRecord": {
        **DIGEST_VERSIONS,
        "admitted_at": None,
        "capture_key": None,
        "chain_hash": REQUIRED,
        "continuation_fingerprint": None,
        "cum_len": REQUIRED,
        "cumulative_hash": REQUIRED,
        "delta_len": REQUIRED,
        "digest": REQUIRED,
        "extras_digest": REQUIRED,
        "fingerprint_version": 0,
        "mode": "token_in",
        "model_call_id": REQUIRED,
        "output_fingerprint": None,
        "parent_call_id": None,
        "prev_len": REQUIRED,
        "response_id": REQUIRED,
        "staging_key": REQUIRED,
        "weight_version": REQUIRED,
    },
    "CaptureAdmission": {
        **VERSIONS,
        "generation_cut": None,
        "mode": REQUIRED,
        "model_call_id": REQUIRED,
        "parent_call_id": None,
        "parent_chain_hash": None,
        "prev_len": 0,
        "required_prefix_token_ids": LIST,
        "rollout_id": REQUIRED,
        "staging_chain": LIST,
    },
    "CaptureLedgerCommit": {
        **VERSIONS,
        "record": REQUIRED,
        "request_items": REQUIRED,
        "response_items": REQUIRED,
        "rollout_id": REQUIRED,
        "staging_chain": (),
    },
    "CommitCoords": {
        **DIGEST_VERSIONS,
        "chain_hash": None,
        "cum_len": REQUIRED,
        "cumulative_hash": None,
        "delta_len": REQUIRED,
        "digest": None,
        "disposition": "staged",
        "extras_digest": None,
        "model_call_id": REQUIRED,
        "parent_call_id": None,
        "prev_len": REQUIRED,
        "rollout_id": REQUIRED,
        "staging_key": None,
        "weight_version": REQUIRED,
    },
    "GenerationCutContinuation": {
        **VERSIONS,
        "effective_output_limit": REQUIRED,
        "prefix_digest": REQUIRED,
        "prefix_token_count": REQUIRED,
        "source_capture_key": REQUIRED,
        "source_model_call_id": REQUIRED,
        "staging_keys": REQUIRED,
        "terminal_finish_reason": None,
        "terminal_stop_reason": None,
    },
    "ManifestFailure": {**VERSIONS, "model_call_id": REQUIRED, "reason": REQUIRED},
    "RolloutManifest": {**VERSIONS, "failures": LIST, "records": LIST, "rollout_id": REQUIRED},
    "RolloutReceipt": {
        **DIGEST_VERSIONS,
        "capture_poisoned": False,
        "failure_reason": None,
        "manifest": LIST,
        "reward": None,
        "rollout_id": REQUIRED,
        "terminal_attribution_reason": None,
        "terminal_model_call_id": None,
        "terminal_selection": None,
    },
    "RolloutRemoval": {**VERSIONS, "absent": LIST, "removed": LIST},
    "StageResult": {**VERSIONS, "error": None, "ok": REQUIRED, "staging_key": None},
    "StagedCallBaseSnapshot": BASE_SNAPSHOT_FIELDS,
    "StagedCallRecord": {**BASE_SNAPSHOT_FIELDS, "extras": None},
    "StagedCallSnapshot": {**BASE_SNAPSHOT_FIELDS, "extras": None},
}
SEED_BASES = {
    "_DigestWireModel": "_WireModel",
    "CallRecord": "_DigestWireModel",
    "CaptureAdmission": "_WireModel",
    "CaptureLedgerCommit": "_WireModel",
    "CommitCoords": "_DigestWireModel",
    "GenerationCutContinuation": "_WireModel",
    "ManifestFailure": "_WireModel",
    "RolloutManifest": "_WireModel",
    "RolloutReceipt": "_DigestWireModel",
    "RolloutRemoval": "_WireModel",
    "StageResult": "_WireModel",
    "StagedCallBaseSnapshot": "_DigestWireModel",
    "StagedCallRecord": "StagedCallBaseSnapshot",
    "StagedCallSnapshot": "StagedCallRecord",
}
SEED_VALIDATORS = {
    "GenerationCutContinuation": ("_validate_staging_keys",),
    "CaptureAdmission": ("_validate_prefix_contract",),
    "StagedCallBaseSnapshot": ("_validate_base_integrity",),
    "StagedCallRecord": ("_validate_extras_integrity",),
    "StageResult": ("_validate_result",),
    "CommitCoords": ("_validate_disposition",),
    "CallRecord": ("_validate_lengths",),
    "RolloutReceipt": ("_validate_manifest", "_validate_attribution_state"),
}


@pytest.mark.parametrize("name", [*SEED_CLASSES, *SEED_DATA, *SEED_CONSTANTS, "staging_key"])
def test_records_exposes_every_seed_name(name: str) -> None:
    assert hasattr(records, name)
    if not name.startswith("_"):
        assert name in records.__all__


@pytest.mark.parametrize(("name", "value"), SEED_CONSTANTS.items())
def test_records_constant_values(name: str, value: object) -> None:
    assert getattr(records, name) == value
    assert type(getattr(records, name)) is type(value)


def test_build_sentinel_is_a_private_plain_object() -> None:
    assert type(records._BUILD_STAGING_DIGEST) is object


@pytest.mark.parametrize("name", SEED_FIELDS)
def test_model_fields_match_the_seed(name: str) -> None:
    model: type[BaseModel] = getattr(records, name)
    fields = model.model_fields
    assert set(fields) == set(SEED_FIELDS[name])
    for field_name, expected in SEED_FIELDS[name].items():
        info = fields[field_name]
        if expected is REQUIRED:
            assert info.is_required(), field_name
        else:
            assert not info.is_required(), field_name
            assert info.get_default(call_default_factory=True) == expected, field_name
    assert model.model_config.get("extra") == "forbid"
    assert model.model_config.get("allow_inf_nan") is False


@pytest.mark.parametrize(("name", "base"), SEED_BASES.items())
def test_model_bases_match_the_seed(name: str, base: str) -> None:
    assert getattr(records, name).__bases__ == (getattr(records, base),)


@pytest.mark.parametrize(("name", "validators"), SEED_VALIDATORS.items())
def test_model_validators_keep_the_seed_names(name: str, validators: tuple[str, ...]) -> None:
    decorators = getattr(records, name).__pydantic_decorators__.model_validators
    assert set(validators) <= set(decorators)


def test_staging_key_and_from_components_surface() -> None:
    assert isinstance(inspect.getattr_static(records.StagedCallBaseSnapshot, "staging_key"), property)
    assert "staging_key" not in records.StagedCallBaseSnapshot.model_fields
    assert records.staging_key("r", "c") == "r/c"
    parameters = list(inspect.signature(records.StagedCallRecord.from_components).parameters)
    assert parameters == [
        "rollout_id",
        "model_call_id",
        "parent_call_id",
        "mode",
        "prev_len",
        "delta_len",
        "cum_len",
        "weight_version",
        "token_ids_delta",
        "token_mask_delta",
        "generation_log_probs_delta",
        "extras",
        "extras_digest",
        "chain_hash",
        "cumulative_hash",
    ]
    assert records.StagedCallSnapshot.from_components.__func__ is records.StagedCallRecord.from_components.__func__  # type: ignore[attr-defined]


def test_no_field_default_is_undefined_for_optional_fields() -> None:
    for name in SEED_FIELDS:
        for field_name, info in getattr(records, name).model_fields.items():
            if not info.is_required():
                assert info.default is not PydanticUndefined or info.default_factory is not None, field_name


def test_sink_never_imports_worker_at_import_time() -> None:
    """Architecture rule: ``worker`` imports ``sink``; ``sink`` never imports ``worker`` at import time (the CLI loads the demo lazily)."""
    import subprocess
    import sys

    modules = [name for name in MODULE_NAMES if name.startswith("sink.")]
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m == 'worker' or m.startswith('worker.'))\n"
        "print(','.join(loaded))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == ""


# --- the top level: the README example's entry points; the rest in the sub-packages -------------------

README_ENTRY_POINTS = (
    "AsyncRedisStagingSink",
    "CaptureGate",
    "RedisCaptureLedger",
    "finished",
    "Assembler",
    "RolloutReader",
)


def test_the_top_level_is_the_readme_entry_points_the_records_and_the_error_root() -> None:
    assert set(sink.__all__) == {*README_ENTRY_POINTS, "StagedCallRecord", "RolloutReceipt", "StagingError"}
    example = (Path(__file__).resolve().parents[1] / "examples" / "quickstart.py").read_text()
    assert f"from sink import {', '.join(sorted(README_ENTRY_POINTS))}\n" in example


def test_an_unknown_top_level_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        sink.no_such_name  # type: ignore[attr-defined]  # noqa: B018
