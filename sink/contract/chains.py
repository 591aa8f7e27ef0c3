"""Multi-chain rollouts: the chain policy and the token-free chain record (contract §14).

A rollout whose agent rewrites its history (context compaction), runs a sub-agent with its own conversation,
or branches deliberately produces calls that extend no earlier call. With a multi-chain policy such a call
starts a new chain (a ``text`` root whose prompt is staged in full) instead of poisoning the rollout, and the
assembler publishes a :class:`RolloutChains` record beside the seed's :class:`RolloutReceipt` (whose
``extra="forbid"`` config cannot carry it). The receipt itself is built exactly as for a single-chain rollout.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, Self

from pydantic import model_validator

from sink.contract.record_base import Identifier, NonNegativeInt, WireModel

__all__ = ("ChainEntry", "ChainPolicy", "ChainSelection", "RolloutChains")


class ChainPolicy(StrEnum):
    """How a rollout's calls form training rows (contract §14.1)."""

    SINGLE = "single"
    """One chain (contract §6.6, §7): an unresolved continuation poisons the rollout; one row."""
    ROOTS = "roots"
    """A call that extends no earlier call starts a new chain; one row per root (its terminal by §7)."""
    BRANCHES = "branches"
    """As ``roots``, and every leaf of a root's tree (identical retries collapsed, §7.3) is a chain."""


ChainSelection = Literal["declared", "response_id", "content", "heuristic", "leaf"]
"""How a chain's terminal was chosen: a witness of §7.2, the §7.4 walk inside the tree, or a leaf (``branches``)."""


class ChainEntry(WireModel):
    """One chain of a rollout: its calls root to terminal, and the rows of its tree that are verified with it."""

    index: NonNegativeInt
    root_call_id: Identifier
    terminal_call_id: Identifier | None = None
    call_ids: tuple[Identifier, ...] = ()
    """Root to terminal; empty when no terminal could be selected."""
    tree_call_ids: tuple[Identifier, ...] = ()
    """Every row of the root's tree, in manifest order (the manifest this chain is verified against); empty
    for a lost chain (its root call failed, so it has no rows)."""
    selection: ChainSelection
    failure_reason: str | None = None
    """Set: this chain is poisoned (the other chains still train)."""

    @model_validator(mode="after")
    def _check_shape(self) -> Self:
        if self.terminal_call_id is None:
            if self.call_ids or self.failure_reason is None:
                raise ValueError("a chain without a terminal has no calls and must carry a failure_reason")
        elif not self.call_ids or self.call_ids[0] != self.root_call_id or self.call_ids[-1] != self.terminal_call_id:
            raise ValueError("call_ids must run from root_call_id to terminal_call_id")
        if not set(self.call_ids) <= set(self.tree_call_ids):
            raise ValueError("a chain's calls must belong to its tree")
        if self.tree_call_ids and self.tree_call_ids.count(self.root_call_id) != 1:
            raise ValueError("a chain's tree holds its root once")
        if not self.tree_call_ids and self.failure_reason is None:
            raise ValueError("a chain without rows must carry a failure_reason")
        return self


class RolloutChains(WireModel):
    """The token-free chain record of one multi-chain rollout, published beside its receipt (contract §14.3)."""

    rollout_id: Identifier
    policy: ChainPolicy
    chains: tuple[ChainEntry, ...] = ()
    failure_reason: str | None = None
    """Set: the whole rollout is poisoned (a failure no chain can be held to, or a failed declaration)."""

    @model_validator(mode="after")
    def _check_chains(self) -> Self:
        if self.policy is ChainPolicy.SINGLE:
            raise ValueError("a single-chain rollout has no chain record")
        if [chain.index for chain in self.chains] != list(range(len(self.chains))):
            raise ValueError("chain indexes must be 0, 1, ... in order")
        if not self.chains and self.failure_reason is None:
            raise ValueError("a chain record without chains must carry a failure_reason")
        return self
