"""Typed views of redis-py replies that a test knows the shape of.

redis-py types every stream reply as ``bytes | str | None`` (and the whole reply as optional) whatever
the client's ``decode_responses``; a test knows which client it holds and that its stream exists, so
these name the shape it gets. They are casts: nothing is converted or checked at run time.
"""

from __future__ import annotations

from typing import cast

from redis.typing import EncodableT, FieldT, StreamRangeResponse, XReadResponse

__all__ = ("RawEntry", "TextEntry", "raw_entries", "text_entries", "text_read", "xadd_fields")

RawEntry = tuple[bytes, dict[bytes, bytes]]
"""One stream entry from a client without ``decode_responses``."""
TextEntry = tuple[str, dict[str, str]]
"""One stream entry from a ``decode_responses=True`` client."""


def raw_entries(reply: StreamRangeResponse | None) -> list[RawEntry]:
    """An XRANGE reply of a client without ``decode_responses``."""
    return cast("list[RawEntry]", reply)


def text_entries(reply: StreamRangeResponse | None) -> list[TextEntry]:
    """An XRANGE reply of a ``decode_responses=True`` client."""
    return cast("list[TextEntry]", reply)


def text_read(reply: XReadResponse) -> list[tuple[str, list[TextEntry]]]:
    """An XREAD reply (RESP2: ``[stream, entries]`` pairs) of a ``decode_responses=True`` client."""
    return cast("list[tuple[str, list[TextEntry]]]", reply)


def xadd_fields(fields: dict[bytes, bytes] | dict[str, str]) -> dict[FieldT, EncodableT]:
    """*fields* as XADD's parameter type (redis-py types it as an invariant dict of any encodable values)."""
    return cast("dict[FieldT, EncodableT]", fields)
