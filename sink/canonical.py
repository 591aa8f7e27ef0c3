"""Canonical JSON, the one serialization the contract hashes and stores: sorted keys, no whitespace, raw UTF-8."""

from __future__ import annotations

import json

__all__ = ("canonical_json",)


def canonical_json(value: object, *, allow_nan: bool = False) -> str:
    """*value* as canonical JSON text.

    NaN and infinities are refused (``ValueError``) unless *allow_nan*; the fingerprint contract serializes them
    as ``NaN``/``Infinity``, the ledger rows and receipts never hold them.

    :raises TypeError: *value* holds something JSON cannot represent (or dict keys of mixed types).
    :raises ValueError: a NaN or infinity without *allow_nan*.
    :raises RecursionError: *value* nests deeper than the interpreter's recursion limit.
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=allow_nan)
