"""The trainer's published weight version: one Redis key per namespace (``ns:weight_version``).

The trainer publishes its version at each weight sync (:meth:`sink.trainer.reader.RolloutReader.publish_weight_version`
or ``staging-sink weights set N``); proxies and workers that get no version from their engine read it
(:class:`worker.weight_version.PublishedWeightVersion`, bounded staleness). The value is a non-negative decimal
integer; anything else in the key is refused loudly, never read as 0.
"""

from __future__ import annotations

from typing import Any

from sink.errors import StagingError
from sink.keys import weight_version_key
from sink.store.connection import map_redis_errors, reply_text

__all__ = ("WeightVersionKeyError", "publish_weight_version", "read_published_weight_version")


class WeightVersionKeyError(StagingError, ValueError):
    """The published weight-version key holds something other than a non-negative decimal integer."""


def _checked(version: object) -> int:
    if type(version) is not int or version < 0:
        raise ValueError(f"weight version must be a non-negative int, got {version!r}")
    return version


async def publish_weight_version(client: Any, namespace: str, version: int) -> None:
    """Set the namespace's published weight version to *version*.

    :raises ValueError: *version* is not a non-negative int.
    :raises sink.errors.StagingConnectionError: the server cannot be reached.
    """
    value = str(_checked(version))
    with map_redis_errors("publish the weight version"):
        await client.set(weight_version_key(namespace), value)


async def read_published_weight_version(client: Any, namespace: str) -> int | None:
    """The namespace's published weight version, or ``None`` when none was published.

    :raises WeightVersionKeyError: the key holds something else than a non-negative decimal integer.
    :raises sink.errors.StagingConnectionError: the server cannot be reached.
    """
    with map_redis_errors("read the published weight version"):
        raw = await client.get(weight_version_key(namespace))
    if raw is None:
        return None
    text = reply_text(raw, lenient=True)  # not UTF-8: refused below as not a number
    if not text.isascii() or not text.isdigit():
        raise WeightVersionKeyError(f"{weight_version_key(namespace)} holds {text!r}, not a non-negative integer")
    return int(text)
