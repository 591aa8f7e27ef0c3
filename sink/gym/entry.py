"""The record types of NeMo Gym's complete-record path: ``TokenEntry`` and ``TokenCaptureSnapshot``.

When ``nemo_gym`` is importable, :func:`entry_types` returns Gym's own classes, so a source hands Gym's
consumer the instances it expects; otherwise it returns :class:`LocalTokenEntry` and
:class:`LocalTokenCaptureSnapshot`, written from the interface facts (same fields, same defaults, same
checks), so a trainer process without ``nemo_gym`` (or on Python 3.11) reads the same rollouts.

:data:`SCHEMA_VERSION` is the newest entry version this package reads: an older or equal one is accepted,
a newer one refused on read.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from pydantic import BaseModel, ConfigDict, model_validator

__all__ = (
    "SCHEMA_VERSION",
    "EntryTypes",
    "LocalTokenCaptureSnapshot",
    "LocalTokenEntry",
    "entry_types",
)

SCHEMA_VERSION: Final = 1
"""The newest ``TokenEntry.schema_version`` this transport reads."""

_GYM_MODULE: Final = "nemo_gym.token_id_capture"


class LocalTokenEntry(BaseModel):
    """One captured model call: the whole prompt, the generated ids and their log-probabilities.

    Unknown extra fields are allowed and kept (they are part of the payload).
    """

    model_config = ConfigDict(extra="allow")

    schema_version: int = SCHEMA_VERSION
    rollout_id: str
    model_call_id: str
    model: str = ""
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    routed_experts: Any | None = None
    output_items: list[dict[str, Any]] = []
    token_item_index: int | None = None
    created_at: float = 0.0

    @model_validator(mode="after")
    def _check_shape(self) -> LocalTokenEntry:
        if len(self.generation_log_probs) != len(self.generation_token_ids):
            raise ValueError(
                f"generation_log_probs has {len(self.generation_log_probs)} values for "
                f"{len(self.generation_token_ids)} generation_token_ids"
            )
        if self.token_item_index is not None and not 0 <= self.token_item_index < len(self.output_items):
            raise ValueError(
                f"token_item_index {self.token_item_index} does not index output_items ({len(self.output_items)} items)"
            )
        return self


@dataclass(frozen=True, slots=True)
class LocalTokenCaptureSnapshot:
    """One frozen rollout: its entries (unique per ``model_call_id``, order without meaning), whether a call
    was lost, and the snapshot's identity (``snapshot_id`` minted at the first freeze, ``version``)."""

    rollout_id: str
    entries: tuple[Any, ...]
    incomplete: bool
    snapshot_id: str
    version: int


class EntryTypes(NamedTuple):
    """The entry and snapshot classes a source builds, and whether they are Gym's own."""

    entry: type[Any]
    snapshot: type[Any]
    from_gym: bool


@functools.cache
def entry_types() -> EntryTypes:
    """Gym's ``TokenEntry`` and ``TokenCaptureSnapshot`` when ``nemo_gym`` is importable, else the local ones."""
    try:
        module = importlib.import_module(_GYM_MODULE)
        return EntryTypes(module.TokenEntry, module.TokenCaptureSnapshot, True)
    except (ImportError, AttributeError):
        return EntryTypes(LocalTokenEntry, LocalTokenCaptureSnapshot, False)
