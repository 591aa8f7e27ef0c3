"""``/v1/completions`` in exact-prefix mode: a continuation's prompt is its parent's exact staged sequence plus the
new suffix, as token ids.

The rule (see :mod:`worker.proxy.exact.text` for how the parent is found): a text prompt that starts with a captured
call's exact text (that call's prompt, then the text it served) continues that call. The proxy sends the engine a
token-id prompt: the parent's exact staged ids (its prompt ids, then its generated ids: the token that completed a
stop string included, which the served text drops), then the suffix tokenized by the engine
(``POST /tokenize {"prompt": suffix, "add_special_tokens": false}``). The engine's ``/v1/completions`` route then
generates from exactly those ids, with its own stop-string, log-prob and detokenization handling, so no
render/generate/derender detour is needed (a completion has no template and no parsers). A token-id prompt is sent
as the agent wrote it: it is exact already; the index only chains it to its parent. A root is sent as written.

After the call is committed its exact text is remembered in ``ns:{R}:ledger:text`` (a hash, expiring
``exact_text_ttl_s`` after its last write; deleted with the rollout when it is abandoned). A lost entry makes the
next call a root: its row is still exact, only its ancestors are not in it.
"""

from __future__ import annotations

import logging
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from redis.asyncio.cluster import RedisCluster

from sink.keys import ledger_text_key
from worker.errors import EnginePayloadError
from worker.proxy.exact.mode import ExactMode
from worker.proxy.exact.text import ExactText, index_entry, match_parent, prompt_text, spell_ids

__all__ = ("TOKENIZE_PATH", "ExactCompletions")

logger = logging.getLogger(__name__)

TOKENIZE_PATH = "/tokenize"


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


class ExactCompletions:
    """The exact-text index of ``/v1/completions`` calls in one namespace, and the token-id prompt of a call."""

    def __init__(self, client: aioredis.Redis | RedisCluster, namespace: str, *, ttl_s: float) -> None:
        self._client, self._namespace, self._ttl_s = client, namespace, ttl_s

    async def plan(self, rollout_id: str, request: dict[str, Any]) -> ExactText | None:
        """The call's prompt matched against the rollout's exact texts (``None``: a prompt shape not handled, or the
        index could not be read: the call goes as in verify mode, a root)."""
        call = prompt_text(request.get("prompt"))
        if call is None:
            return None
        try:
            raw = await self._client.hgetall(ledger_text_key(self._namespace, rollout_id))
        except redis_errors.RedisError as exc:
            logger.error("rollout %s: cannot read the exact-text index (%r); the call is a root", rollout_id, exc)
            return None
        index = {_bytes(field): _bytes(value) for field, value in raw.items()}
        return match_parent(call, index)

    async def request(
        self, exact: ExactMode, call: ExactText, request: dict[str, Any], parent_ids: list[int] | None
    ) -> tuple[int, Any, dict[str, Any]]:
        """The request for the engine: a text continuation's prompt becomes ``parent_ids`` + the tokenized suffix.

        :returns: ``(status, error body, request)``: status 200 and the request to send, or the ``/tokenize`` error
            (nothing generated).
        :raises EnginePayloadError: a ``/tokenize`` answer without a list of ids.
        """
        if call.kind != "t" or not call.parent_segments or not parent_ids:
            return 200, None, request
        suffix: list[int] = []
        if call.suffix:
            body = {"model": request.get("model"), "prompt": call.suffix, "add_special_tokens": False}
            status, answer = await exact.call(TOKENIZE_PATH, body)
            if status != 200:
                return status, answer, request
            tokens = answer.get("tokens") if isinstance(answer, dict) else None
            if not isinstance(tokens, list) or not all(type(token) is int and token >= 0 for token in tokens):
                raise EnginePayloadError(f"POST {TOKENIZE_PATH} answered no list of token ids: {answer!r:.200}")
            suffix = tokens
        return 200, None, {**request, "prompt": [*parent_ids, *suffix]}

    async def remember(self, rollout_id: str, call: ExactText, payload: dict[str, Any], request: dict[str, Any]) -> None:
        """Remember a committed call's exact text (its served text; for a token-id prompt its generated ids), and,
        when a stop string it dropped from the text ended it, that text followed by the stop string."""
        try:
            choice = payload["choices"][0]
            served = choice["text"] if call.kind == "t" else spell_ids(choice["token_ids"])
        except (KeyError, IndexError, TypeError) as exc:
            logger.warning("rollout %s: no exact text to remember (%r); its continuation will be a root", rollout_id, exc)
            return
        if not isinstance(served, str):
            return
        entries = [index_entry(call, served)]
        stop = choice.get("stop_reason")
        if call.kind == "t" and isinstance(stop, str) and stop and request.get("include_stop_str_in_output") is not True:
            entries.append(index_entry(call, served, stop))
        key = ledger_text_key(self._namespace, rollout_id)
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.hset(key, mapping=dict(entries))
                pipe.expire(key, max(1, int(self._ttl_s)))
                await pipe.execute()
        except redis_errors.RedisError as exc:
            logger.error("rollout %s: cannot remember the exact text (%r); its continuation will be a root", rollout_id, exc)
