"""Sampling provenance: how a staged call's tokens were sampled, as its extras carry it (``extras["sampling"]``).

The capture proxy writes, for every staged call, the effective sampling parameters into the record's extras under
:data:`SAMPLING_EXTRAS_KEY`, so the extras digest (contract §4.6) covers them. The entry is a dict of plain JSON
values (:meth:`SamplingProvenance.as_extras`):

``source`` (``"engine"``: the engine's own effective parameters; ``"request"``: the agent's request),
``temperature``, ``top_p``, ``min_p``, ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``
(float or ``None``), ``top_k``, ``seed``, ``max_tokens`` (int or ``None``), ``min_tokens`` (int),
``ignore_eos`` (bool), ``logit_bias`` (bool: a logit bias, allowed token ids or bad words reshaped the
distribution), ``constraint`` (``None``, ``"structured_outputs"`` or ``"tool_choice"``: grammar-constrained
decoding) and ``logprobs_mode`` (the engine's log-prob mode where it reports one, else ``None``).

What it means for training (:meth:`SamplingProvenance.off_policy_prefix`): a staged log-prob is the model's own
only when the engine reports raw log-probs (vLLM's default; ``logprobs_mode`` ``None`` or ``"raw_logprobs"``)
and no grammar constrained the call: under a constraint the engine reports the constrained distribution's
log-prob (a grammar-forced token comes back as 0.0). A token sampled under a logit bias was not drawn from the
model's distribution, and ``min_tokens`` suppresses the end of turn on the first ``min_tokens`` generated
positions. Temperature, top-p/top-k/min-p and the penalties are recorded; vLLM's reported log-probs are taken
before them (a trainer applies its own temperature).

A call staged without the entry (older records, the library API) has no provenance: :meth:`from_extras` returns
``None``. Keys beyond the documented ones are ignored (a later writer may add some).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Final, Literal, get_args

from sink.errors import SamplingProvenanceError

__all__ = (
    "MODEL_LOGPROBS_MODES",
    "SAMPLING_EXTRAS_KEY",
    "SAMPLING_FIELD_TYPES",
    "Constraint",
    "SamplingProvenance",
    "SamplingSource",
)

SAMPLING_EXTRAS_KEY: Final = "sampling"
"""The extras key of a staged call's sampling provenance."""
MODEL_LOGPROBS_MODES: Final = frozenset({"raw_logprobs"})
"""Engine log-prob modes whose values are the model's own log-probabilities (``None``, not reported, counts too)."""

SamplingSource = Literal["engine", "request"]
Constraint = Literal["structured_outputs", "tool_choice"]

SAMPLING_FIELD_TYPES: Final[dict[str, type]] = {
    "source": str,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": float,
    "seed": int,
    "max_tokens": int,
    "min_tokens": int,
    "ignore_eos": bool,
    "logit_bias": bool,
    "constraint": str,
    "logprobs_mode": str,
}
"""The entry's fields in order, each with its scalar type (the optional ones may also be ``None``)."""
_FLOATS: Final = tuple(name for name, kind in SAMPLING_FIELD_TYPES.items() if kind is float)
_OPTIONAL_INTS: Final = ("top_k", "seed", "max_tokens")
_BOOLS: Final = ("ignore_eos", "logit_bias")


@dataclass(frozen=True, slots=True)
class SamplingProvenance:
    """One staged call's sampling provenance (the module docstring gives each field's meaning)."""

    source: SamplingSource
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    seed: int | None
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    logit_bias: bool
    constraint: Constraint | None
    logprobs_mode: str | None

    @property
    def reshaped(self) -> bool:
        """Every generated token's staged log-prob or sampling is not the model's: a grammar constraint, a logit
        bias, or an engine log-prob mode other than the model's raw log-probs."""
        return (
            self.constraint is not None
            or self.logit_bias
            or (self.logprobs_mode is not None and self.logprobs_mode not in MODEL_LOGPROBS_MODES)
        )

    def off_policy_prefix(self, generated: int) -> int:
        """How many of the call's *generated* tokens, from its first, are not sampled from the model's own
        distribution with the model's log-prob: all of them when :attr:`reshaped`, else the first
        ``min_tokens`` (the end of turn was suppressed there). The rest are policy tokens."""
        return generated if self.reshaped else min(self.min_tokens, generated)

    def as_extras(self) -> dict[str, Any]:
        """The entry to store under ``extras["sampling"]`` (plain JSON values, encodable by contract §4.6)."""
        return asdict(self)

    @classmethod
    def from_extras(cls, extras: Mapping[str, Any] | None) -> SamplingProvenance | None:
        """The provenance in a staged call's *extras*, or ``None`` when it has none (no extras, no entry).

        The caller checks *extras* against the call's ``extras_digest`` first (contract §4.6).

        :raises SamplingProvenanceError: the entry is not of the documented shape (the message names the field).
        """
        if extras is None or SAMPLING_EXTRAS_KEY not in extras:
            return None
        return cls.parse(extras[SAMPLING_EXTRAS_KEY])

    @classmethod
    def parse(cls, entry: object) -> SamplingProvenance:
        """The provenance an ``extras["sampling"]`` entry holds.

        :raises SamplingProvenanceError: *entry* is not a dict of the documented shape (the message names the field).
        """
        if type(entry) is not dict:
            raise SamplingProvenanceError(f"the sampling entry must be a dict, got {type(entry).__name__}")
        fields: dict[str, Any] = {name: _field(entry, name) for name in SAMPLING_FIELD_TYPES}
        if fields["source"] not in get_args(SamplingSource):
            raise SamplingProvenanceError(f"sampling source must be 'engine' or 'request', got {fields['source']!r}")
        for name in _FLOATS:
            fields[name] = _optional_float(name, fields[name])
        for name in _OPTIONAL_INTS:
            if fields[name] is not None and type(fields[name]) is not int:
                raise SamplingProvenanceError(f"sampling {name} must be an int or None, got {fields[name]!r}")
        if type(fields["min_tokens"]) is not int or fields["min_tokens"] < 0:
            raise SamplingProvenanceError(f"sampling min_tokens must be an int >= 0, got {fields['min_tokens']!r}")
        for name in _BOOLS:
            if type(fields[name]) is not bool:
                raise SamplingProvenanceError(f"sampling {name} must be a bool, got {fields[name]!r}")
        if fields["constraint"] is not None and fields["constraint"] not in get_args(Constraint):
            raise SamplingProvenanceError(
                f"sampling constraint must be None, 'structured_outputs' or 'tool_choice', got {fields['constraint']!r}"
            )
        if fields["logprobs_mode"] is not None and type(fields["logprobs_mode"]) is not str:
            raise SamplingProvenanceError(
                f"sampling logprobs_mode must be a str or None, got {fields['logprobs_mode']!r}"
            )
        return cls(**fields)


def _field(entry: dict[Any, Any], name: str) -> Any:
    try:
        return entry[name]
    except KeyError:
        raise SamplingProvenanceError(f"the sampling entry has no {name!r}") from None


def _optional_float(name: str, value: object) -> float | None:
    if value is None:
        return None
    if type(value) not in (int, float) or not math.isfinite(value):  # type: ignore[arg-type]
        raise SamplingProvenanceError(f"sampling {name} must be a finite number or None, got {value!r}")
    return float(value)  # type: ignore[arg-type]


assert tuple(SAMPLING_FIELD_TYPES) == tuple(SamplingProvenance.__dataclass_fields__), "the field table drifted"
