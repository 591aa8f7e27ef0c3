"""The exception tree of staging-sink: one root, a few documented leaves.

Every exception class of ``sink`` lives here, and every error the library raises derives from
:class:`StagingError` (the worker's errors in :mod:`worker.errors` derive from it too). Some leaves also derive
from a builtin: ``ValueError``/``RuntimeError`` where the wire contract names that builtin, so callers written
against the reference system keep working, and ``ImportError`` for a missing optional extra.

A durability failure of ``stage()`` is not an exception: it reports ``StageResult(ok=False, error=...)``. Every
other acknowledged write (ledger rows, ``finished`` events, receipts, acknowledgements) raises
:class:`NotDurableError`. The NeMo Gym transport (:mod:`sink.gym`) follows Gym's protocol instead and raises
:class:`CaptureWriteError`.
"""

from __future__ import annotations

import copy
from typing import Self

__all__ = (
    "BatchInputError",
    "CaptureWriteError",
    "ClusterModeMismatchError",
    "CodecError",
    "ExtraMissingError",
    "FingerprintInputError",
    "GymInputError",
    "InvalidCallIdError",
    "LedgerConflictError",
    "MetricsExtraMissingError",
    "NotDurableError",
    "RebuildError",
    "ReceiptVerificationError",
    "RolloutFrozenError",
    "RolloutRetiredError",
    "RowUnavailableError",
    "SamplingProvenanceError",
    "ServerNotFoundError",
    "ServerProcessError",
    "StagingConnectionError",
    "StagingError",
    "StagingKeyOwnershipError",
    "StagingRefusedError",
    "StagingUnavailableError",
    "TokenEntryConflictError",
    "UnrecoverableServiceError",
)


class StagingError(Exception):
    """Root of every error raised by staging-sink."""


class CodecError(StagingError):
    """Raised when a stored record blob is malformed, truncated, oversized or
    tampered with (its digest no longer matches), or when a record cannot be
    encoded. Nothing partial is ever returned alongside it."""


class StagingConnectionError(StagingError):
    """The server did not carry out a command: it could not be reached (:class:`StagingUnavailableError`) or it
    answered with an error (:class:`StagingRefusedError`). Every one raised is one of the two; catch this base
    where both mean the same to you, a leaf where they do not. The message names the server error."""

    def restated(self, message: str) -> Self:
        """The same error (same class, same reply code) with *message*, to re-raise with more context."""
        other = copy.copy(self)
        other.args = (message,)
        return other


class StagingUnavailableError(StagingConnectionError):
    """The server could not carry out the command now: it could not be reached (connection refused or reset, a
    timeout, DNS), it answered that it cannot serve yet (``LOADING``, ``MASTERDOWN``), or the cluster's topology
    changed under the client (``MOVED``, ``ASK``, ``READONLY``, ``TRYAGAIN``, ``CLUSTERDOWN``: a failover or a slot
    migration; the client reloads its slot map before the next attempt). Waiting may fix it: services ride it out
    up to their ``max_outage_s``. ``code`` is the reply's code when the server answered, ``None`` when it could
    not be reached."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code

    def __reduce__(self) -> tuple[type[StagingUnavailableError], tuple[str, str | None]]:
        # Rebuild from (message, code), so the error survives pickling with its code intact.
        return (type(self), (str(self), self.code))


class StagingRefusedError(StagingConnectionError):
    """The server answered the command with an error reply that is not a topology change. ``code`` is the reply's
    code (its first word: ``WRONGTYPE``, ``NOPERM``, ``OOM``, ``WRONGPASS``, ``NOGROUP``, ``ERR``...). Sending the
    same command again gets the same answer: services stop at once."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code

    def __reduce__(self) -> tuple[type[StagingRefusedError], tuple[str, str]]:
        # Rebuild from (message, code), so the error survives pickling with its code intact.
        return (type(self), (str(self), self.code))


class NotDurableError(StagingUnavailableError):
    """Raised instead of acknowledging a write (ledger row, ``finished`` event, receipt, dead letter,
    acknowledgement) when the round trip that carried it shows the server would not keep it through a crash:
    ``appendonly``/``appendfsync``/``no-appendfsync-on-rewrite``/``maxmemory-policy`` not the durable values,
    ``WAITAOF`` not confirming the fsync, or the check itself refused (``NOPERM``). The write may have been
    applied; it is not acknowledged, and retrying it is safe (every such write is idempotent). The message names
    the server and what is wrong. A :class:`StagingUnavailableError`, so services treat it as an outage and
    retry (up to their ``max_outage_s``) until an operator restores the configuration."""


class LedgerConflictError(StagingError, ValueError):
    """Raised when a ledger row for a ``model_call_id`` already exists with
    different contents. The stored row is unchanged; the message contains
    ``conflicting`` and names the differing fields.

    ``differing_fields``: dotted names of the row fields that differ (empty
    when only the encoding differs), or ``None`` when the stored row is
    unreadable."""

    def __init__(self, rollout_id: str, model_call_id: str, differing_fields: tuple[str, ...] | None) -> None:
        if differing_fields is None:
            differs = "unreadable stored row"
        else:
            differs = ", ".join(differing_fields) or "encoding"
        super().__init__(
            f"conflicting ledger row for model_call_id {model_call_id!r} in rollout {rollout_id!r} "
            f"(differs in: {differs}); the stored row is unchanged"
        )
        self.rollout_id = rollout_id
        self.model_call_id = model_call_id
        self.differing_fields = differing_fields

    def __reduce__(self) -> tuple[type[LedgerConflictError], tuple[str, str, tuple[str, ...] | None]]:
        # Rebuild from the fields so the error survives pickling with them intact.
        return (type(self), (self.rollout_id, self.model_call_id, self.differing_fields))


class StagingKeyOwnershipError(StagingError, ValueError):
    """A ledger row names a staging key or ``capture_key`` that is not its rollout's own (nothing changed).

    A row may name only keys ``<owner>/<call>`` (or ``<owner>/<call>/cut/<checkpoint>/<seq>``) whose owner
    is its ``capture_key``, or the rollout itself; a capture key may name only the rollout or another
    attempt of it (``<rollout>-a<n>``).
    """


class InvalidCallIdError(StagingError, ValueError):
    """A model call id that would collide with a generation-cut key (it contains ``/cut/``)."""


class RolloutRetiredError(StagingError, RuntimeError):
    """Raised when reading the ledger of a rollout that was retired (fenced)."""

    def __init__(self, rollout_id: str) -> None:
        super().__init__(f"rollout {rollout_id!r} is retired")
        self.rollout_id = rollout_id


class ReceiptVerificationError(StagingError, ValueError):
    """Raised when the trainer-side verification of a receipt and its staged
    snapshots fails (contract §8.1). ``code`` is the stable machine-readable
    check code (for example ``wrong_digest``, ``row_count_mismatch``);
    ``detail`` is a human-readable explanation. The message is
    ``"<code>: <detail>"``."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail

    def __reduce__(self) -> tuple[type[ReceiptVerificationError], tuple[str, str]]:
        # Rebuild from (code, detail) so the error survives pickling (e.g. across
        # a process pool) with its fields intact.
        return (type(self), (self.code, self.detail))


class RebuildError(ReceiptVerificationError):
    """Raised when the manifest's call graph or the terminal's chain cannot be
    rebuilt: a missing parent, a length gap, a lineage cycle, a missing
    terminal, a broken chain or cumulative hash, or a bad mask layout
    (contract §8.1 steps 9-13)."""


class ServerNotFoundError(StagingError):
    """Raised when no ``valkey-server``/``redis-server`` binary can be found. The message says what to install."""


class ServerProcessError(StagingError):
    """Raised when a server process dies at startup, is not ready before its deadline, or does not stop
    cleanly. The message ends with the tail of the server's log."""


class ExtraMissingError(StagingError, ImportError):
    """Raised when an optional extra a feature needs is not installed; the message names the extra."""


class MetricsExtraMissingError(ExtraMissingError):
    """Raised when ``prometheus_client`` is not installed: install the ``metrics`` extra."""


class BatchInputError(StagingError, ValueError):
    """Raised when a training-batch step (:mod:`sink.trainer.batch`, :mod:`sink.trainer.packing`, :mod:`sink.trainer.export`,
    :func:`sink.trainer.statistics.mismatch_report`) is given invalid input: an option out of range, an item that is
    not a pulled rollout, a rollout id twice, a column of the wrong length. Nothing was built; the message names the
    offending value."""


class RowUnavailableError(StagingError, LookupError):
    """Raised when an export by rollout id finds no stored receipt (not finished, or acknowledged already) or
    a staged record the receipt names is gone. Nothing was written."""


class SamplingProvenanceError(StagingError, ValueError):
    """Raised when a staged call's ``extras["sampling"]`` entry is not of the documented shape
    (:class:`sink.contract.sampling.SamplingProvenance`); the message names the field."""


class FingerprintInputError(StagingError, ValueError):
    """Raised when a conversation item or content block has a shape the
    fingerprint contract does not define (a non-dict item, a content block
    without a type, a non-string id, an unserializable value). It is a
    ``ValueError``, as the contract requires."""


class ClusterModeMismatchError(StagingError):
    """Raised when the cluster mode asked for (``cluster=True``/``--cluster``, or ``False``/``--no-cluster``)
    differs from what the server reports (``INFO cluster``: ``cluster_enabled``). Nothing was changed."""


class UnrecoverableServiceError(StagingError):
    """Raised by a long-running service (assembler, trainer) on a failure that retrying cannot fix: the
    server refused a command (:class:`StagingRefusedError`: ``NOPERM``, a wrong password, a key of the wrong
    type), or a consumer group cannot be recreated. The service stops at once; the command exits 1."""


class TokenEntryConflictError(StagingError, ValueError):
    """NeMo Gym transport: a ``put`` of another payload under a ``model_call_id`` the rollout holds already.
    The stored entry is kept and the rollout is marked incomplete (its snapshot ``version`` changes)."""


class GymInputError(StagingError, ValueError):
    """NeMo Gym transport: an argument or entry the transport refuses (an invalid rollout or call id, an entry
    field that breaks the entry's rules, a non-finite log-prob, a drop identity of the wrong type); nothing was
    written. A ``ValueError``, as Gym's own store raises for bad input."""


class RolloutFrozenError(StagingError, RuntimeError):
    """NeMo Gym transport: a ``put`` or ``begin_call`` of a rollout that was frozen (nothing was written)."""


class CaptureWriteError(StagingError, RuntimeError):
    """NeMo Gym transport: a write could not be confirmed durable (the server is not fsync-durable, too few
    replicas acknowledged, the server refused or could not be reached): nothing may be assumed stored."""
