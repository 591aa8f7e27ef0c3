"""The engine-specific extraction a capture uses; its implementations are in :mod:`worker.adapters`."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ("CaptureAdapter", "ExtrasAdded")


@runtime_checkable
class CaptureAdapter(Protocol):
    """Engine-specific extraction used by ``complete_call_from_response``.

    A payload the adapter cannot read (a missing or malformed field, a payload that contradicts itself) raises
    :class:`~worker.errors.EnginePayloadError` naming the field: the capture records the call failed. Any other
    exception is a bug and propagates to the host.
    """

    def enter_prefix(self, request: Any, prefix_ids: list[int]) -> Any:
        """Return *request* with the exact prefix attached (the engine must start its prompt with it)."""
        ...

    def extract_prompt_ids(self, response: Any) -> list[int]:
        """The exact prompt ids the engine consumed."""
        ...

    def extract_generation(self, response: Any) -> tuple[list[int], list[float]]:
        """Generated ids and their log-probabilities (Python floats), equal in length."""
        ...

    def extract_extras(self, response: Any) -> dict[str, Any] | None:
        """Engine-native per-token extras (e.g. routed experts), or ``None``."""
        ...


class ExtrasAdded:
    """*adapter* whose extras also hold *extras* (what the host knows of the call beyond the engine's payload, such
    as the proxy's sampling provenance): a key of *extras* wins over the engine's."""

    def __init__(self, adapter: CaptureAdapter, extras: dict[str, Any]) -> None:
        self._adapter, self._extras = adapter, extras

    def enter_prefix(self, request: Any, prefix_ids: list[int]) -> Any:
        """As the wrapped adapter."""
        return self._adapter.enter_prefix(request, prefix_ids)

    def extract_prompt_ids(self, response: Any) -> list[int]:
        """As the wrapped adapter."""
        return self._adapter.extract_prompt_ids(response)

    def extract_generation(self, response: Any) -> tuple[list[int], list[float]]:
        """As the wrapped adapter."""
        return self._adapter.extract_generation(response)

    def extract_extras(self, response: Any) -> dict[str, Any] | None:
        """The wrapped adapter's extras, with the added ones."""
        return {**(self._adapter.extract_extras(response) or {}), **self._extras}
