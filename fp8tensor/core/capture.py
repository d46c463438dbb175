"""Which CUDA-graph capture (if any) the current stream is in (:func:`capture_token`, the key of fp8tensor's one
cache), and what a capture's graph must keep alive (:func:`keep_for_replays`, held by :class:`Capture`)."""
from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch

__all__ = ["capture_token", "begin_capture", "end_capture", "keep_for_replays", "Capture"]

_generation = 0
_local = threading.local()  # .active: weak reference to this thread's Capture in progress (begin_capture), or None


class Capture:
    """One capture of :class:`fp8tensor.graphs.GraphedStep`: its generation number, the stream it records, and the
    objects its graph reads at every replay (pinned host buffers), kept alive with it."""

    __slots__ = ("generation", "stream", "kept", "__weakref__")

    def __init__(self, generation: int, stream=None):
        self.generation, self.stream, self.kept = generation, stream, []


def begin_capture(stream: Optional["torch.cuda.Stream"] = None) -> Capture:
    """Start a new capture generation in this thread (call right before a CUDA-graph capture on ``stream``);
    returns its :class:`Capture`."""
    global _generation
    _generation += 1
    c = Capture(_generation, stream)
    _local.active = weakref.ref(c)
    return c


def end_capture(c: Capture) -> None:
    """The capture ``c`` is over (captured or failed)."""
    active = getattr(_local, "active", None)
    if active is not None and active() is c:
        _local.active = None


def keep_for_replays(obj) -> bool:
    """Keep ``obj`` alive as long as the graph being captured: True inside this thread's :func:`begin_capture`
    capture on its stream; False otherwise (the caller keeps ``obj`` itself)."""
    active = getattr(_local, "active", None)
    c = active() if active is not None else None
    if c is None or not torch.cuda.is_current_stream_capturing():
        return False
    if c.stream is not None and torch.cuda.current_stream() != c.stream:
        return False
    c.kept.append(obj)
    return True


def capture_token() -> int:
    """``0`` when the current CUDA stream is not capturing a graph (or CUDA is unavailable or uninitialized), else
    the generation number of the capture (>= 1, see :func:`begin_capture`). Costs one C call; no device sync."""
    if not torch.cuda.is_initialized() or not torch.cuda.is_current_stream_capturing():
        return 0
    return max(_generation, 1)
