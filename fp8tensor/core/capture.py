"""Which CUDA-graph capture (if any) the current stream is in, for the few Python-side caches fp8tensor keeps.

A CUDA graph replays the kernels recorded during its capture and none of the Python that launched them. A cache
that hands out a tensor computed *before* the capture would therefore be baked into the graph as a constant: every
replay would read the old values. The caches of fp8tensor (the eager fp8 copy of a Linear input shared by the
Linears that consume it, the results of one FSDP2 group-quantization launch kept for the group's later weights, the
device copies of kernel argument tables) key their entries with :func:`capture_token`, so an entry made outside a
capture (or in another capture) is never served inside one.

:func:`begin_capture` is called by :class:`fp8tensor.graphs.GraphedStep` before each capture; a capture made with
``torch.cuda.graph`` directly still gets a token different from "not capturing".
"""
from __future__ import annotations

import torch

__all__ = ["capture_token", "begin_capture"]

_generation = 0


def begin_capture() -> int:
    """Start a new capture generation (call right before a CUDA-graph capture); returns its number (>= 1)."""
    global _generation
    _generation += 1
    return _generation


def capture_token() -> int:
    """``0`` when the current CUDA stream is not capturing a graph (or CUDA is unavailable or uninitialized), else
    the generation number of the capture (>= 1, see :func:`begin_capture`). Costs one C call; no device sync."""
    if not torch.cuda.is_initialized() or not torch.cuda.is_current_stream_capturing():
        return 0
    return max(_generation, 1)
