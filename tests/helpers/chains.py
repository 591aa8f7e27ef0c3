"""Multi-chain rollouts on a real server (contract §14): trees of consistent records, staged and committed."""

from __future__ import annotations

from sink.contract.chains import ChainPolicy
from sink.contract.records import CaptureLedgerCommit, StagedCallRecord
from sink.keys import DEFAULT_NAMESPACE
from sink.ledger.redis import RedisCaptureLedger
from sink.store.sink import AsyncRedisStagingSink
from tests.helpers.e2e import call_record_of
from tests.helpers.staging import make_record

__all__ = ("chain_tree", "stage_two_trees")


def chain_tree(rollout_id: str, root_id: str, *children: tuple[str, str]) -> list[StagedCallRecord]:
    """A root and children given as ``(call id, parent call id)``, every record consistent (digests, hashes)."""
    records = {root_id: make_record(rollout_id, root_id, carry=3)}
    sequences = {root_id: list(records[root_id].token_ids_delta)}
    for call_id, parent_id in children:
        parent = records[parent_id]
        records[call_id] = make_record(
            rollout_id, call_id, carry=2, parent=parent, parent_prefix=sequences[parent_id], weight_version=2
        )
        sequences[call_id] = sequences[parent_id] + list(records[call_id].token_ids_delta)
    return list(records.values())


async def stage_two_trees(
    url: str, rollout_id: str, policy: ChainPolicy, *, namespace: str = DEFAULT_NAMESPACE
) -> list[list[StagedCallRecord]]:
    """Stage two trees under *policy* in *namespace*: ``a0 <- a1`` and ``b0 <- b1 <- b2``, each call committed to
    the ledger."""
    trees = [chain_tree(rollout_id, "a0", ("a1", "a0")), chain_tree(rollout_id, "b0", ("b1", "b0"), ("b2", "b1"))]
    async with (
        AsyncRedisStagingSink.from_url(url, namespace=namespace) as sink,
        RedisCaptureLedger.from_url(url, namespace=namespace) as ledger,
    ):
        await ledger.record_chain_policy(rollout_id, policy)
        admitted = 0.0
        for tree in trees:
            chains: dict[str, tuple[str, ...]] = {}
            for record in tree:
                assert (await sink.stage(record)).ok
                chain = (*chains.get(record.parent_call_id or "", ()), record.staging_key)
                chains[record.model_call_id] = chain
                admitted += 1.0
                row = call_record_of(record, admitted_at=admitted)
                commit = CaptureLedgerCommit(
                    rollout_id=rollout_id, record=row, staging_chain=chain, request_items=[], response_items=[]
                )
                await ledger.record(commit)
    return trees
