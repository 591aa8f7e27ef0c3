"""Inference-worker side of token staging: per-call capture, adapters, generation cuts, simulated engine."""

from __future__ import annotations

from .adapters import CaptureAdapter as CaptureAdapter
from .adapters import MegatronAdapter as MegatronAdapter
from .adapters import VLLMChatAdapter as VLLMChatAdapter
from .adapters import install_capture as install_capture
from .call import ActiveCall as ActiveCall
from .capture import RolloutTokenCapture as RolloutTokenCapture
from .errors import CaptureError as CaptureError
from .errors import GenerationCutError as GenerationCutError
from .errors import PrefixResolutionError as PrefixResolutionError
from .errors import StreamingUnsupportedError as StreamingUnsupportedError
from .prefix import aresolve_prefix as aresolve_prefix
from .prefix import resolve_prefix as resolve_prefix

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
