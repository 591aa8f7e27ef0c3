"""Per-chain terminal selection: a multi-chain rollout's :class:`RolloutChains` record (contract §14.2, §14.3).

:func:`build_chains` is pure, like :func:`sink.rollout.receipt.build_receipt`, whose receipt it reads: the
receipt is built exactly as for one chain, and the chain record, published beside it, says which rows train.

* A **tree** is a root (a parentless row) and every row descending from it, in manifest order.
* ``roots``: one chain per tree. Its terminal is the receipt's witness terminal (§7.2) when that row is in the
  tree, else the §7.4 walk over the tree's rows alone; a failed walk poisons that chain only.
* ``branches``: one chain per leaf of each tree, identical retries collapsed (§7.3).
* A failure row whose call claimed a parent poisons the chains through that parent (``roots``: the parent's
  tree); a failed ``text`` root is a lost chain of its own. A failure nobody can be held to (no recorded
  claim, a parent outside the manifest, a malformed custody row), a failed declaration or disagreeing
  witnesses, a repeated call id, an orphaned row or a cycle poison the whole rollout.
"""

from __future__ import annotations

from collections.abc import Sequence

from sink.contract.chains import ChainEntry, ChainPolicy, ChainSelection, RolloutChains
from sink.contract.records import (
    TERMINAL_DUPLICATE_CALL_ID,
    TERMINAL_NO_ROOT,
    TERMINAL_ORPHANED_ROW,
    TERMINAL_SELECTED,
    CallRecord,
    RolloutManifest,
    RolloutReceipt,
)
from sink.ledger.rows import ChainLedgerView
from sink.rollout.terminal import collapse_candidates, select_terminal_call

__all__ = ("CHAINS_FIELD", "LedgerRead", "build_chains", "chain_fields")

CHAINS_FIELD = "chains"
"""The ``ns:receipts:<k>`` entry field holding the chain record's JSON (absent for a single-chain rollout)."""

LedgerRead = tuple[RolloutManifest, ChainLedgerView]

_WITNESSES = ("declared", "response_id", "content")


def _trees(rows: Sequence[CallRecord]) -> dict[str, list[CallRecord]] | str:
    """Rows grouped by their root's call id (roots in manifest order), or the structural failure reason."""
    by_id = {row.model_call_id: row for row in rows}
    root_of: dict[str, str] = {}
    for row in rows:
        seen: list[str] = []
        node = row
        while node.parent_call_id is not None and node.model_call_id not in root_of:
            seen.append(node.model_call_id)
            parent = by_id.get(node.parent_call_id)
            if parent is None:
                return TERMINAL_ORPHANED_ROW
            if parent.model_call_id in seen:
                return TERMINAL_NO_ROOT
            node = parent
        root = root_of.get(node.model_call_id, node.model_call_id)
        for call_id in (*seen, node.model_call_id):
            root_of[call_id] = root
    trees: dict[str, list[CallRecord]] = {row.model_call_id: [] for row in rows if row.parent_call_id is None}
    for row in rows:
        trees[root_of[row.model_call_id]].append(row)
    return trees


def _path(terminal: str, by_id: dict[str, CallRecord]) -> tuple[str, ...]:
    path = [terminal]
    while (parent := by_id[path[-1]].parent_call_id) is not None:
        path.append(parent)
    return tuple(reversed(path))


def _leaves(tree: list[CallRecord]) -> list[str]:
    parents = {row.parent_call_id for row in tree}
    groups: dict[tuple[str, str, int], list[CallRecord]] = {}
    for row in tree:
        if row.model_call_id not in parents:
            groups.setdefault((row.cumulative_hash, row.chain_hash, row.cum_len), []).append(row)
    kept = {kept.model_call_id for group in groups.values() if (kept := collapse_candidates(group)) is not None}
    return [row.model_call_id for row in tree if row.model_call_id in kept]


def _tree_terminals(
    tree: list[CallRecord], receipt: RolloutReceipt, policy: ChainPolicy
) -> list[tuple[str | None, ChainSelection, str | None]]:
    """``(terminal, selection, walk failure)`` of each chain of one tree."""
    if policy is ChainPolicy.BRANCHES:
        return [(leaf, "leaf", None) for leaf in _leaves(tree)]
    ids = {row.model_call_id for row in tree}
    witness = receipt.terminal_model_call_id
    if witness in ids and receipt.terminal_selection in _WITNESSES:
        return [(witness, receipt.terminal_selection, None)]
    walk = select_terminal_call(tree)
    failure = None if walk.reason == TERMINAL_SELECTED else walk.reason
    return [(walk.terminal_model_call_id, "heuristic", failure)]


def _rollout_failure(receipt: RolloutReceipt, manifest: RolloutManifest, view: ChainLedgerView) -> str | None:
    if receipt.terminal_attribution_reason == TERMINAL_DUPLICATE_CALL_ID:
        return TERMINAL_DUPLICATE_CALL_ID
    if receipt.terminal_model_call_id is None and receipt.terminal_selection in _WITNESSES:
        return receipt.terminal_attribution_reason or receipt.failure_reason  # a failed declaration / disagreement
    claimed = {(failure.model_call_id, failure.reason) for failure in view.failures}
    for failure in manifest.failures:
        if (failure.model_call_id, failure.reason) not in claimed:
            return failure.reason  # a malformed custody row: nothing to hold it to
    return None


def build_chains(receipt: RolloutReceipt, manifest: RolloutManifest, view: ChainLedgerView) -> RolloutChains | None:
    """The chain record of a multi-chain rollout, or ``None`` for ``single`` and for a state-3 receipt.

    :param receipt: what :func:`~sink.rollout.receipt.build_receipt` made of *manifest*.
    :param view: the policy and failure claims read with *manifest* (``manifest_and_chains``).
    """
    if view.policy is ChainPolicy.SINGLE or (receipt.terminal_selection is None and not receipt.manifest):
        return None
    rows = receipt.manifest
    by_id = {row.model_call_id: row for row in rows}
    failure = _rollout_failure(receipt, manifest, view)
    trees = _trees(rows)
    if isinstance(trees, str):
        failure, trees = failure or trees, {}
    tree_of = {row.model_call_id: root for root, tree in trees.items() for row in tree}
    chains: list[ChainEntry] = []
    for root, tree in trees.items():
        tree_ids = tuple(row.model_call_id for row in tree)
        for terminal, selection, walk_failure in _tree_terminals(tree, receipt, view.policy):
            path = _path(terminal, by_id) if terminal is not None else ()
            reason = walk_failure
            for claim in view.failures:
                if claim.parent_call_id is None or tree_of.get(claim.parent_call_id) != root:
                    continue
                if view.policy is ChainPolicy.ROOTS or claim.parent_call_id in path:
                    reason = reason or claim.reason
            chains.append(
                ChainEntry(
                    index=len(chains),
                    root_call_id=root,
                    terminal_call_id=terminal,
                    call_ids=path,
                    tree_call_ids=tree_ids,
                    selection=selection,
                    failure_reason=reason,
                )
            )
    for claim in view.failures:
        if claim.root:
            chains.append(
                ChainEntry(
                    index=len(chains),
                    root_call_id=claim.model_call_id,
                    selection="heuristic",
                    failure_reason=claim.reason,
                )
            )
        elif claim.parent_call_id is None or claim.parent_call_id not in tree_of:
            failure = failure or claim.reason
    if not chains:
        failure = failure or receipt.failure_reason or "no_chains"
    return RolloutChains(
        rollout_id=receipt.rollout_id, policy=view.policy, chains=tuple(chains), failure_reason=failure
    )


def chain_fields(receipt_text: str, read: LedgerRead | None) -> dict[str, str]:
    """The receipts-entry fields of a rollout's chain record: ``{}`` or ``{"chains": <json>}``.

    Built from the **stored** receipt (*receipt_text*, an earlier assembly's when one won the ``SET NX``), so
    the record always describes the receipt it rides beside; *read* is the manifest and view read now (failure
    rows only append, so a later read can only poison more).
    """
    if read is None:
        return {}
    receipt = RolloutReceipt.model_validate_json(receipt_text)
    chains = build_chains(receipt, read[0], read[1])
    return {} if chains is None else {CHAINS_FIELD: chains.model_dump_json()}
