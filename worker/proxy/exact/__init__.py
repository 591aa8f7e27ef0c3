"""Exact-prefix mode: a continuation's prompt is its parent's exact staged sequence, on vLLM's token-in/token-out
routes.

One module per role, in the order a call meets them: :mod:`~worker.proxy.exact.probe` (what the engine offers, once
at start), :mod:`~worker.proxy.exact.mode` (the mode the proxy runs in and its engine calls),
:mod:`~worker.proxy.exact.splice` (the rule that splices a rendered continuation onto its parent's ids),
:mod:`~worker.proxy.exact.chat` (one chat call over render, generate and derender),
:mod:`~worker.proxy.exact.answers` (the chat route's answer and its staged call), and
:mod:`~worker.proxy.exact.text` with :mod:`~worker.proxy.exact.completions` (the completions route: a text prompt's
parent found by its exact text). Nothing is re-exported here: import from the module.
"""

__all__ = ()
