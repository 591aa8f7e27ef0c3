"""Parent resolution when an empty reply makes two calls match one request (§6.5): the call whose reply is the
request's last model-authored item is the parent; a retry of the earlier turn still resolves to the earlier call;
two calls with one context stay ambiguous."""

from __future__ import annotations

from typing import Any

from sink.contract.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint, conversation_digest
from sink.ledger.lineage import AMBIGUOUS_REASON, LineageStatus, resolve_from_rows

SYSTEM = {"role": "system", "content": "s"}
USER = {"role": "user", "content": "u"}


def row(call_id: str, request: list[dict[str, Any]], reply: dict[str, Any], cum_len: int) -> dict[str, Any]:
    """The custody row of a call that answered *request* with *reply* (the fields resolution reads)."""
    return {
        "fingerprint_version": FINGERPRINT_VERSION,
        "fingerprint": assistant_fingerprint([*request, reply]),
        "context_len": len(request),
        "context_digest": conversation_digest(request),
        "record": {
            "model_call_id": call_id,
            "cum_len": cum_len,
            "cumulative_hash": f"h-{call_id}",
            "chain_hash": f"c-{call_id}",
        },
        "staging_chain": [f"R/{call_id}"],
    }


ANSWER = {"role": "assistant", "content": "x"}
EMPTY = {"role": "assistant", "content": ""}
TOOL0 = {"role": "tool", "content": "r0", "tool_call_id": "t0"}
TOOL1 = {"role": "tool", "content": "r1", "tool_call_id": "t1"}
FIRST = [SYSTEM, USER]
SECOND = [SYSTEM, USER, ANSWER, TOOL0]
ROWS = [row("c1", FIRST, ANSWER, 10), row("c2", SECOND, EMPTY, 14)]


def test_the_call_after_an_empty_reply_resolves_to_the_empty_reply() -> None:
    resolution = resolve_from_rows([*SECOND, EMPTY, TOOL1], ROWS)
    assert resolution.status is LineageStatus.RESOLVED and resolution.match is not None
    assert resolution.match.model_call_id == "c2"


def test_a_retry_of_the_earlier_turn_resolves_to_the_earlier_call() -> None:
    resolution = resolve_from_rows(SECOND, ROWS)
    assert resolution.status is LineageStatus.RESOLVED and resolution.match is not None
    assert resolution.match.model_call_id == "c1"


def test_two_calls_on_one_context_stay_ambiguous() -> None:
    rows = [row("c1", FIRST, ANSWER, 10), row("c1b", FIRST, ANSWER, 11)]
    resolution = resolve_from_rows(SECOND, rows)
    assert (resolution.status, resolution.reason) == (LineageStatus.UNRESOLVED, AMBIGUOUS_REASON)
