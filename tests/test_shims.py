"""The seed's import paths (``sink.records``, ``sink.digest``, ``sink.protocols``) re-export their targets'
objects, the same objects, every public name (and the seed API's private names of the records)."""

from __future__ import annotations

import importlib

import pytest

SHIMS = {
    "sink.records": "sink.contract.records",
    "sink.digest": "sink.contract.digest",
    "sink.protocols": "sink.contract.protocols",
}
# Names the seed API lists that the target keeps out of its __all__.
SEED_PRIVATE = {"sink.records": ("_WireModel", "_DigestWireModel", "_BUILD_STAGING_DIGEST")}


@pytest.mark.parametrize("shim", sorted(SHIMS))
def test_the_shim_exposes_the_same_objects_as_its_target(shim: str) -> None:
    module, target = importlib.import_module(shim), importlib.import_module(SHIMS[shim])
    private = SEED_PRIVATE.get(shim, ())
    assert set(module.__all__) == set(target.__all__) | set(private)
    for name in (*target.__all__, *private):
        assert getattr(module, name) is getattr(target, name), name


def test_the_seed_record_names_are_importable_from_sink_records() -> None:
    from sink.records import CallRecord, RolloutReceipt, StagedCallRecord, _DigestWireModel, _WireModel, staging_key

    assert issubclass(CallRecord, _DigestWireModel) and issubclass(_DigestWireModel, _WireModel)
    assert issubclass(StagedCallRecord, _WireModel) and issubclass(RolloutReceipt, _WireModel)
    assert callable(staging_key)
