"""The trainer's published weight version: one Redis key per namespace (``ns:weight_version``).

The trainer publishes its version at each weight sync (:meth:`sink.trainer.reader.rollout_reader.RolloutReader.publish_weight_version`
or ``staging-sink weights set N``); proxies and workers that get no version from their engine read it
(:class:`worker.weight_version.PublishedWeightVersion`, bounded staleness). The value is a decimal integer the
record's ``weight_version`` carries (a ``u64``: ``[0, 2**64)``): publishing anything else is refused
(:class:`InvalidWeightVersionError`, nothing written), and anything else found in the key (written by hand) is
refused loudly when read (:class:`WeightVersionKeyError`), never read as 0.

Each publish also writes ``ns:weight_version:last`` (after the version itself), which nothing deletes: a namespace
with that key and no published version had its published version **deleted** (by hand, ``DEL``), a loud state
(:func:`read_published_state`): proxies log it and count the calls they stamp with their fallback meanwhile,
``staging-sink stats --check`` fails on it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from sink.contract.digest_encoding import decimal_u64, is_u64
from sink.errors import StagingError
from sink.keys import last_weight_version_key, weight_version_key
from sink.store.connection import map_redis_errors, reply_text

__all__ = (
    "InvalidWeightVersionError",
    "PublishedState",
    "WeightVersionKeyError",
    "checked_weight_version",
    "publish_weight_version",
    "read_published_state",
    "read_published_weight_version",
)

_RANGE = "not an integer in [0, 2**64) (the record's u64 weight_version)"


class InvalidWeightVersionError(StagingError, ValueError):
    """A weight version the record cannot carry: not an exact int in ``[0, 2**64)``."""


class WeightVersionKeyError(StagingError, ValueError):
    """The published weight-version key holds something the record cannot carry (not a decimal integer in
    ``[0, 2**64)``)."""


class PublishedState(NamedTuple):
    """A namespace's published weight version, and whether one was deleted."""

    version: int | None
    """The published version; ``None`` when there is none."""
    deleted: int | None
    """With no published version: the last one published when there was one (its key was deleted), else ``None``."""


def checked_weight_version(version: object) -> int:
    """*version*, if the record's ``weight_version`` carries it.

    :raises InvalidWeightVersionError: not an exact int (``bool`` and ``float`` refused) in ``[0, 2**64)``.
    """
    if not is_u64(version):
        raise InvalidWeightVersionError(f"weight version {version!r} is {_RANGE}")
    return version


async def publish_weight_version(client: Any, namespace: str, version: int) -> None:
    """Set the namespace's published weight version to *version*.

    :raises InvalidWeightVersionError: the record cannot carry *version* (nothing is written).
    :raises sink.errors.StagingConnectionError: the server cannot be reached.
    """
    value = str(checked_weight_version(version))
    with map_redis_errors("publish the weight version"):
        await client.set(weight_version_key(namespace), value)
        await client.set(last_weight_version_key(namespace), value)  # after it: the marker never claims more


async def _read(client: Any, key: str) -> int | None:
    with map_redis_errors("read the published weight version"):
        raw = await client.get(key)
    if raw is None:
        return None
    text = reply_text(raw, lenient=True)  # not UTF-8: refused below as not a number
    version = decimal_u64(text)
    if version is None:
        raise WeightVersionKeyError(f"{key} holds {text!r}, {_RANGE}")
    return version


async def read_published_weight_version(client: Any, namespace: str) -> int | None:
    """The namespace's published weight version, or ``None`` when none was published.

    :raises WeightVersionKeyError: the key holds something the record cannot carry (not a decimal integer in
        ``[0, 2**64)``).
    :raises sink.errors.StagingConnectionError: the server cannot be reached.
    """
    return await _read(client, weight_version_key(namespace))


async def read_published_state(client: Any, namespace: str) -> PublishedState:
    """The namespace's published weight version, or, when there is none, the last one published before (if any).

    :raises WeightVersionKeyError: a key holds something the record cannot carry.
    :raises sink.errors.StagingConnectionError: the server cannot be reached.
    """
    version = await read_published_weight_version(client, namespace)
    if version is not None:
        return PublishedState(version, None)
    return PublishedState(None, await _read(client, last_weight_version_key(namespace)))
