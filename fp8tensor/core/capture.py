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

import weakref

import torch

__all__ = ["capture_token", "begin_capture", "end_capture", "keep_for_replays", "Capture"]

_generation = 0
_active = None  # weak reference to the Capture in progress (made by begin_capture), else None


class Capture:
    """One capture of :class:`fp8tensor.graphs.GraphedStep`: its generation number and the objects its graph reads at
    every replay (the pinned host buffers of its host-to-device copy nodes), alive exactly as long as this object,
    which the step keeps with its graph."""

    __slots__ = ("generation", "kept", "__weakref__")

    def __init__(self, generation: int):
        self.generation, self.kept = generation, []


def begin_capture() -> Capture:
    """Start a new capture generation (call right before a CUDA-graph capture); returns its :class:`Capture`."""
    global _generation, _active
    _generation += 1
    c = Capture(_generation)
    _active = weakref.ref(c)
    return c


def end_capture(c: Capture) -> None:
    """The capture ``c`` is over (captured or failed)."""
    global _active
    if _active is not None and _active() is c:
        _active = None


def keep_for_replays(obj) -> bool:
    """Keep ``obj`` alive as long as the graph being captured (a :func:`begin_capture` capture in progress on this
    stream); False when there is none (a capture made with ``torch.cuda.graph`` directly: the caller keeps it)."""
    c = _active() if _active is not None else None
    if c is None or not torch.cuda.is_current_stream_capturing():
        return False
    c.kept.append(obj)
    return True


def capture_token() -> int:
    """``0`` when the current CUDA stream is not capturing a graph (or CUDA is unavailable or uninitialized), else
    the generation number of the capture (>= 1, see :func:`begin_capture`). Costs one C call; no device sync."""
    if not torch.cuda.is_initialized() or not torch.cuda.is_current_stream_capturing():
        return 0
    return max(_generation, 1)
