"""The verified training row and its parts (contract §8.2).

:class:`LinearizedRow` is built only by :mod:`sink.trainer.verify` from verified
data. Its token columns come in one of two forms: tuples of the snapshots'
values, or the packed bytes of the chain calls (when every call was decoded
packed). In the packed form nothing per token exists in Python until a column
is read: :meth:`LinearizedRow.as_numpy` reads the bytes directly, and the
``token_*`` tuples are built on first access and then kept.

numpy is a default dependency, imported lazily: this module imports
it only inside :meth:`LinearizedRow.as_numpy`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from sink.contract.packed import PackedColumns
from sink.contract.sampling import SamplingProvenance

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ("ExtrasCommitment", "LinearizedRow", "LinkSpan", "NumpyColumns", "RowColumns", "WeightVersionSpan")

_Tuples = tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...]]


class WeightVersionSpan(NamedTuple):
    """Row positions ``[start, end)`` produced by one call under one weight version."""

    model_call_id: str
    start: int
    end: int
    weight_version: int


class LinkSpan(NamedTuple):
    """How one chain call contributes to the row: carried prompt tokens, then generated ones."""

    model_call_id: str
    carry_count: int
    generated_count: int


class ExtrasCommitment(NamedTuple):
    """The extras digest a chain call committed to; verify fetched extras against it at point of use."""

    model_call_id: str
    extras_digest_version: int
    extras_digest: str


class NumpyColumns(NamedTuple):
    """The token columns of a :class:`LinearizedRow` as fresh numpy arrays."""

    token_ids: npt.NDArray[np.int64]
    token_mask: npt.NDArray[np.float32]
    logprobs: npt.NDArray[np.float32]


class RowColumns:
    """A row's three token columns: given as tuples, or as packed parts turned into tuples on first use.

    Compares (and hashes) by the tuples, so a packed row equals a row built
    from lists with the same values. Building the tuples twice from two
    threads is harmless: both results are equal and either one is kept.
    """

    __slots__ = ("_parts", "_tuples")

    def __init__(self, *, tuples: _Tuples | None = None, parts: Sequence[PackedColumns] | None = None) -> None:
        if (tuples is None) == (parts is None):
            raise ValueError("RowColumns takes exactly one of tuples= or parts=")
        self._tuples = tuples
        self._parts = None if parts is None else tuple(parts)

    @property
    def packed_parts(self) -> tuple[PackedColumns, ...] | None:
        """The chain calls' packed columns, root first, when the row was built from them."""
        return self._parts

    @property
    def tuples(self) -> _Tuples:
        """``(token_ids, token_mask, logprobs)`` as tuples."""
        tuples = self._tuples
        if tuples is None:
            parts = self._parts or ()
            tuples = self._tuples = (
                tuple(itertools.chain.from_iterable(part.token_ids_list() for part in parts)),
                tuple(itertools.chain.from_iterable(part.token_mask_list() for part in parts)),
                tuple(itertools.chain.from_iterable(part.log_probs_list() for part in parts)),
            )
        return tuples

    def __len__(self) -> int:
        if self._parts is not None:
            return sum(part.length for part in self._parts)
        return len(self.tuples[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RowColumns):
            return NotImplemented
        return self.tuples == other.tuples

    def __hash__(self) -> int:
        return hash(self.tuples)

    def as_numpy(self) -> NumpyColumns:
        """Fresh arrays: straight from the packed bytes when there are any, else from the tuples."""
        np = _import_numpy()
        total = len(self)
        out = NumpyColumns(
            np.empty(total, dtype=np.int64), np.empty(total, dtype=np.float32), np.empty(total, dtype=np.float32)
        )
        self.write_numpy(out)
        return out

    def write_numpy(self, out: NumpyColumns) -> None:
        """Write the columns into *out*'s three 1-D arrays (or views) of this row's length: the one copy."""
        if self._parts is not None:
            _packed_into(self._parts, out)
        else:
            _columns_into(self.tuples, out)


@dataclass(frozen=True, slots=True, repr=False)
class LinearizedRow:
    """One verified training row: the terminal call's ancestry, root first.

    A frozen, slotted dataclass (not a pydantic model: it is built only by
    :mod:`sink.trainer.verify` from verified data, so re-validation would be pure
    cost). Every field is immutable and the row is hashable. Column values are
    exactly the snapshots' values (a ``-0.0`` mask or log-probability keeps its
    sign). Equal inputs give equal rows.
    """

    rollout_id: str
    columns: RowColumns
    model_call_ids: tuple[str, ...]
    prompt_len: int
    weight_versions: tuple[int, ...]
    weight_version_spans: tuple[WeightVersionSpan, ...]
    link_spans: tuple[LinkSpan, ...]
    extras_commitments: tuple[ExtrasCommitment, ...]
    chain_index: int = 0
    """The chain of a multi-chain rollout this row trains (contract §14.4); 0 for a single-chain rollout."""
    sampling: tuple[SamplingProvenance | None, ...] = ()
    """Per chain call (root first, like :attr:`model_call_ids`): how its tokens were sampled, from its extras'
    ``sampling`` entry (checked against its extras digest), or ``None`` when the call has none (unknown)."""

    @property
    def provenance_known(self) -> bool:
        """Every call of the row has sampling provenance (else :meth:`policy_mask` counts the unknown calls'
        generated tokens as policy tokens)."""
        return len(self.sampling) == len(self.model_call_ids) and None not in self.sampling

    def policy_mask(self) -> npt.NDArray[np.bool_]:
        """Per token, aligned with :attr:`token_ids`: True where the staged log-prob is the model's own and the
        token was sampled from the model's (tempered, truncated) distribution, so a loss or an importance ratio
        may use it (a new array on every call).

        False on carried prompt tokens (mask 0.0); on every generated token of a call that ran under a grammar
        constraint (structured outputs, a named or required ``tool_choice``), a logit bias (or allowed token ids,
        bad words) or an engine log-prob mode other than raw log-probs; and on the first ``min_tokens`` generated
        tokens of a call (the end of turn was suppressed there). A call without provenance counts as unconstrained:
        its generated tokens are True (see :attr:`provenance_known`).

        :raises ImportError: numpy is not installed (a default dependency: reinstall staging-sink).
        """
        out: npt.NDArray[np.bool_] = _import_numpy().empty(len(self.columns), dtype=bool)
        self.write_policy_mask(out)
        return out

    def write_policy_mask(self, out: npt.NDArray[np.bool_]) -> None:
        """:meth:`policy_mask` written into a caller-owned 1-D bool array or view of ``len(self.columns)``
        elements (e.g. one row of a batch).

        :raises ValueError: *out* has the wrong shape.
        """
        if out.shape != (len(self.columns),):
            raise ValueError(f"write_policy_mask needs a 1-D target of {len(self.columns)} elements")
        out[:] = False
        sampling = self.sampling or (None,) * len(self.link_spans)
        for span, link, provenance in zip(self.weight_version_spans, self.link_spans, sampling, strict=True):
            skipped = 0 if provenance is None else provenance.off_policy_prefix(link.generated_count)
            out[span.start + link.carry_count + skipped : span.end] = True

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Token ids, root to terminal (built on first access for a packed row)."""
        return self.columns.tuples[0]

    @property
    def token_mask(self) -> tuple[float, ...]:
        """Loss mask: 0.0 for carried prompt tokens, 1.0 for generated ones."""
        return self.columns.tuples[1]

    @property
    def logprobs(self) -> tuple[float, ...]:
        """Behaviour log-probabilities (0.0 on carried tokens)."""
        return self.columns.tuples[2]

    @property
    def call_ids(self) -> tuple[str, ...]:
        """Alias of :attr:`model_call_ids` (root to terminal)."""
        return self.model_call_ids

    def as_numpy(self) -> NumpyColumns:
        """Return ``(token_ids int64, token_mask float32, logprobs float32)`` as new arrays.

        The arrays are fresh on every call, so callers may mutate them.
        Float32 keeps the sign of ``-0.0`` and is exactly what the digests cover.

        :raises ImportError: numpy is not installed (a default dependency: reinstall staging-sink).
        :raises OverflowError: a token id does not fit in int64.
        """
        return self.columns.as_numpy()

    def write_numpy(
        self, token_ids: npt.NDArray[np.int64], token_mask: npt.NDArray[np.float32], logprobs: npt.NDArray[np.float32]
    ) -> None:
        """Write the columns into three caller-owned 1-D arrays or views of ``len(self.columns)`` elements
        (int64, float32, float32), e.g. one row of a batch: no array is allocated on the way.

        :raises ImportError: numpy is not installed.
        :raises ValueError: a target has the wrong length.
        :raises OverflowError: a token id does not fit in int64.
        """
        self.columns.write_numpy(NumpyColumns(token_ids, token_mask, logprobs))

    def __repr__(self) -> str:
        # The columns can hold tens of thousands of tokens; keep logs readable.
        return (
            f"LinearizedRow(rollout_id={self.rollout_id!r}, tokens={len(self.columns)}, "
            f"prompt_len={self.prompt_len}, model_call_ids={self.model_call_ids!r}, "
            f"weight_versions={self.weight_versions!r})"
        )


def _import_numpy() -> Any:
    try:
        import numpy
    except ImportError as exc:
        raise ImportError(
            "LinearizedRow.as_numpy needs numpy, a default dependency of staging-sink: pip install numpy"
        ) from exc
    return numpy


def _packed_into(parts: Sequence[PackedColumns], out: NumpyColumns) -> None:
    """Columns straight from packed bytes into *out*: no per-token Python object, no copy but the one into it."""
    np = _import_numpy()
    total = sum(part.length for part in parts)
    ids, mask, logprobs = out
    if not ids.shape == mask.shape == logprobs.shape == (total,):
        raise ValueError(f"write_numpy needs three 1-D targets of {total} elements")
    stored_ids = [np.frombuffer(part.ids_le, dtype="<u4" if part.ids_width == 4 else "<u8") for part in parts]
    for stored in stored_ids:
        if stored.dtype.itemsize == 8 and stored.size and int(stored.max()) >= 1 << 63:
            raise OverflowError("a token id does not fit in int64")
    # One pass each over the parts (converted as they are copied in): ids widened, log-probs to host order.
    np.concatenate(stored_ids, out=ids)  # u64 ids proved below 2**63 just above
    np.concatenate([np.frombuffer(part.lp_f32be, dtype=">f4") for part in parts], out=logprobs)
    mask[:] = 1.0  # the generated tokens; each part's carry is written over it
    start = 0
    for part in parts:
        end = start + part.length
        carry = part.usual_carry_length()
        if carry is not None:  # the usual shape: +0.0 carry, then 1.0
            mask[start : start + carry] = 0.0
        else:
            mask_of_code = np.zeros(256, dtype=np.float32)
            mask_of_code[0x80] = -0.0
            mask_of_code[0x3F] = 1.0
            np.take(mask_of_code, np.frombuffer(part.mask_codes, dtype=np.uint8), out=mask[start:end])
        start = end


def _columns_into(tuples: tuple[Sequence[int], Sequence[float], Sequence[float]], out: NumpyColumns) -> None:
    """Columns from the Python sequences into *out* (one C-level pass per column)."""
    np = _import_numpy()
    total = len(tuples[0])
    if not out.token_ids.shape == out.token_mask.shape == out.logprobs.shape == (total,):
        raise ValueError(f"write_numpy needs three 1-D targets of {total} elements")
    out.token_ids[:] = np.array(tuples[0], dtype=np.int64)
    out.token_mask[:] = np.array(tuples[1], dtype=np.float32)
    out.logprobs[:] = np.array(tuples[2], dtype=np.float32)
