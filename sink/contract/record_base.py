"""The wire base of every record: type aliases (contract §2.2), the default staging key, the versioned base models.

Version fields accept exactly the supported version (:func:`sink.contract.record_schema.unsupported_version`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from sink.contract.record_schema import (
    EXTRAS_DIGEST_VERSION,
    STAGING_DIGEST_VERSION,
    STAGING_SCHEMA_VERSION,
    SUPPORTED_VERSIONS,
    unsupported_version,
)

__all__ = (
    "CaptureDisposition",
    "CaptureMode",
    "DigestHex",
    "DigestWireModel",
    "Identifier",
    "NonNegativeInt",
    "PositiveInt",
    "WireModel",
    "staging_key",
)

Identifier = Annotated[StrictStr, Field(min_length=1)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]
DigestHex = Annotated[StrictStr, Field(pattern="^[0-9a-f]{64}$")]
CaptureMode = Literal["token_in", "text"]
CaptureDisposition = Literal["staged", "capture_failed"]


def staging_key(rollout_id: str, model_call_id: str) -> str:
    """Return the default deterministic key used by the NeMo RL backend."""
    if not rollout_id or not model_call_id:
        raise ValueError("staging_key needs a non-empty rollout_id and model_call_id")
    return f"{rollout_id}/{model_call_id}"


def _exact_version(value: object, name: str) -> object:
    # Literal[2] alone would accept True/2.0; versions must be exact ints.
    if problem := unsupported_version(name, value, SUPPORTED_VERSIONS[name]):
        raise ValueError(problem)
    return value


class WireModel(BaseModel):
    """Every record: strict (no unknown fields, no NaN/inf) and versioned (``_WireModel`` in the seed API)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    schema_version: Literal[2] = STAGING_SCHEMA_VERSION

    @field_validator("schema_version", mode="before")
    @classmethod
    def _check_schema_version(cls, value: object) -> object:
        return _exact_version(value, "schema_version")


class DigestWireModel(WireModel):
    """A record that carries digests, with their versions (``_DigestWireModel`` in the seed API)."""

    digest_version: Literal[2] = STAGING_DIGEST_VERSION
    extras_digest_version: Literal[1] = EXTRAS_DIGEST_VERSION

    @field_validator("digest_version", mode="before")
    @classmethod
    def _check_digest_version(cls, value: object) -> object:
        return _exact_version(value, "digest_version")

    @field_validator("extras_digest_version", mode="before")
    @classmethod
    def _check_extras_digest_version(cls, value: object) -> object:
        return _exact_version(value, "extras_digest_version")
