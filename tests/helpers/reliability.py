"""Shared by the reliability suites: ledger commits for staged records, a keyspace audit, measured counts.

The audit SCANs a server (or every primary of a cluster) and checks the staging invariants directly on
the stored keys: every record has exactly one ``calls`` entry and every ``calls`` entry its record, no
ledger row lacks its record, and no ``model_call_id`` has two ledger rows.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import redis

from sink.contract.records import CaptureLedgerCommit, RolloutManifest, StagedCallRecord
from sink.ledger.rows import manifest_from_entries
from tests.helpers.e2e import call_record_of
from tests.helpers.replies import raw_entries

__all__ = (
    "KeyspaceAudit",
    "audit_keyspace",
    "commit_of",
    "record_measurement",
)

NS = "stg"
_KEY_RE = re.compile(r"^" + re.escape(NS) + r":\{([^}]*)\}:(.*)$")


def commit_of(record: StagedCallRecord, *, staging_chain: Sequence[str] = ()) -> CaptureLedgerCommit:
    """The custody commit a gate records after *record* was staged (``ok=True``)."""
    row = call_record_of(record, admitted_at=1000.0)
    chain = tuple(staging_chain) or (record.staging_key,)
    return CaptureLedgerCommit(
        rollout_id=record.rollout_id, record=row, staging_chain=chain, request_items=[], response_items=[]
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class KeyspaceAudit:
    """What one SCAN found, per rollout, and the invariant violations (empty when consistent)."""

    records: dict[str, set[str]] = field(default_factory=dict)
    """rollout -> staging keys of stored records."""
    calls: dict[str, Counter[str]] = field(default_factory=dict)
    """rollout -> staging key -> number of ``calls`` entries."""
    manifests: dict[str, RolloutManifest] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def record_count(self) -> int:
        return sum(len(keys) for keys in self.records.values())

    @property
    def calls_entry_count(self) -> int:
        return sum(sum(counter.values()) for counter in self.calls.values())

    @property
    def ledger_row_count(self) -> int:
        return sum(len(manifest.records) for manifest in self.manifests.values())

    def all_record_keys(self) -> set[str]:
        return {key for keys in self.records.values() for key in keys}

    def ledger_keys(self) -> set[str]:
        return {row.staging_key for manifest in self.manifests.values() for row in manifest.records}

    def assert_consistent(self) -> None:
        """:raises AssertionError: naming every violation found."""
        assert not self.problems, "keyspace invariants violated:\n" + "\n".join(self.problems[:20])


def _check(audit: KeyspaceAudit) -> None:
    rollouts = set(audit.records) | set(audit.calls) | set(audit.manifests)
    for rollout in sorted(rollouts):
        stored = audit.records.get(rollout, set())
        entries = audit.calls.get(rollout, Counter())
        if orphans := stored - set(entries):
            audit.problems.append(f"{rollout}: records without a calls entry: {sorted(orphans)[:5]}")
        if dangling := set(entries) - stored:
            audit.problems.append(f"{rollout}: calls entries without a record: {sorted(dangling)[:5]}")
        if duplicated := [key for key, count in entries.items() if count > 1]:
            audit.problems.append(f"{rollout}: duplicate calls entries: {sorted(duplicated)[:5]}")
        manifest = audit.manifests.get(rollout)
        if manifest is None:
            continue
        rows = [row.model_call_id for row in manifest.records]
        if len(rows) != len(set(rows)):
            audit.problems.append(f"{rollout}: duplicate ledger rows: {sorted(Counter(rows) - Counter(set(rows)))}")
        if without := {row.staging_key for row in manifest.records} - stored:
            audit.problems.append(f"{rollout}: ledger rows without a record: {sorted(without)[:5]}")


def audit_keyspace(clients: Iterable[redis.Redis]) -> KeyspaceAudit:
    """SCAN every client's keyspace (one per primary) and check the staging invariants."""
    audit = KeyspaceAudit()
    for client in clients:
        for raw in client.scan_iter(match=f"{NS}:{{*", count=1000):
            key = _text(raw)
            match = _KEY_RE.match(key)
            if match is None:
                continue
            rollout, rest = match.groups()
            if rest.startswith("rec:"):
                audit.records.setdefault(rollout, set()).add(f"{rollout}/{rest[4:]}")
            elif rest == "calls":
                counter = audit.calls.setdefault(rollout, Counter())
                for _entry_id, fields in raw_entries(client.xrange(key)):
                    counter[_text(fields[b"key"])] += 1
            elif rest == "ledger":
                entries = [
                    {_text(k): _text(v) for k, v in fields.items()}
                    for _entry_id, fields in raw_entries(client.xrange(key))
                ]
                audit.manifests[rollout] = manifest_from_entries(rollout, entries)
    _check(audit)
    return audit


def record_measurement(name: str, **counts: float | str) -> None:
    """Print one measured line, and append it as JSON to ``$RELIABILITY_REPORT`` when that is set.

    docs/reliability.md is filled from these lines, so its numbers are the ones the tests measured.
    """
    line = {"test": name, **counts}
    print(f"RELIABILITY {json.dumps(line, sort_keys=True)}")
    path = os.environ.get("RELIABILITY_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(line, sort_keys=True) + "\n")
