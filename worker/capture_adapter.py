"""The engine-specific extraction a capture uses; its implementations are in :mod:`worker.adapters`."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ("CaptureAdapter",)


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
