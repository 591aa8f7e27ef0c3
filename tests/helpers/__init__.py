"""Shared test helpers: contract examples, staging builders, reliability and end-to-end harnesses, a TCP fault proxy."""
