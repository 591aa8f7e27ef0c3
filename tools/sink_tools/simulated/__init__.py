"""The simulated inference engine: a deterministic engine and rollout driver, and its OpenAI-compatible HTTP app."""

__all__ = ()
