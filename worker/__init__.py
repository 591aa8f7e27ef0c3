"""Inference-worker side of token staging: per-call capture, adapters, generation cuts, simulated engine."""

from __future__ import annotations

from worker.adapters import CaptureAdapter as CaptureAdapter
from worker.adapters import MegatronAdapter as MegatronAdapter
from worker.adapters import VLLMChatAdapter as VLLMChatAdapter
from worker.adapters import install_capture as install_capture
from worker.call import ActiveCall as ActiveCall
from worker.capture import RolloutTokenCapture as RolloutTokenCapture
from worker.errors import CaptureError as CaptureError
from worker.errors import GenerationCutError as GenerationCutError
from worker.errors import PrefixResolutionError as PrefixResolutionError
from worker.errors import StreamingUnsupportedError as StreamingUnsupportedError
from worker.prefix import aresolve_prefix as aresolve_prefix
from worker.prefix import resolve_prefix as resolve_prefix

__all__ = (
    "ActiveCall",
    "CaptureAdapter",
    "CaptureError",
    "GenerationCutError",
    "MegatronAdapter",
    "PrefixResolutionError",
    "RolloutTokenCapture",
    "StreamingUnsupportedError",
    "VLLMChatAdapter",
    "aresolve_prefix",
    "install_capture",
    "resolve_prefix",
)
