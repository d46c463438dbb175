"""The one cache of quantized operands: an fp8 copy of a tensor that several GEMMs read is made once.

Entries are keyed by the source tensor's identity and version, the kind of copy (row-wise e4m3 input, per-token
grad_weight operand, the per-group columns of expert tokens, ...), any further tensors the copy depends on (the group
offsets of grouped GEMMs) and the CUDA-graph capture (:func:`fp8tensor.core.capture.capture_token`: a copy made
outside a capture is never served inside one, where it would be baked into the graph). Two ways of holding a value:

* ``weak=True``: the cache holds a weak reference; the copy lives exactly as long as a backward keeps it (the
  grad_weight operand of an input read by q/k/v or w1/w3), so a hit never costs memory.
* held (default): one copy per kind, replaced by the next source's (freed before it is made) and dropped by
  :meth:`OperandCache.clear` when a backward starts. ``fp8tensor.config(share_input_quantization=False)`` turns held
  entries off (same bits, more quantization work, less fp8 memory between GEMMs).

While ``torch.compile`` traces, under a dispatch mode, or for inference tensors (no version counter) nothing is
cached: compiled graphs share operands through common-subexpression elimination.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch

from ..core import compat
from ..core.capture import capture_token
from ..core.settings import get_config

__all__ = ["OperandCache", "OPERANDS"]


class OperandCache:
    """Quantized copies of tensors, keyed by ``(source identity, version, kind, tensors also read, capture)``."""

    def __init__(self):
        self._entries: dict = {}  # id(source) -> (weakref(source), {kind: (key, also, value or weakref, weak)})
        self._held: dict = {}  # kind -> id(source) whose entry holds that kind's value

    def get(self, kind, source: torch.Tensor, make: Callable, *also: torch.Tensor, weak: bool = False):
        """``make()``, or the value it returned before for ``source`` at its current version (and the same ``also``
        tensors at their versions, in the same CUDA-graph capture or outside any)."""
        if (compat.is_compiling() or source.is_inference() or compat.dispatch_modes_active()
                or not (weak or get_config().share_input_quantization)):
            return make()
        key = (source._version, capture_token(), *(t._version for t in also))
        i = id(source)
        e = self._entries.get(i)
        if e is not None and e[0]() is source:
            hit = e[1].get(kind)
            if hit is not None and hit[0] == key and all(a is b for a, b in zip(hit[1], also)):
                value = hit[2]() if hit[3] else hit[2]
                if value is not None:
                    return value
        if not weak:
            self.clear(kind)  # the previous source's copy is freed before this one is made
        value = make()
        if e is None or e[0]() is not source:
            e = self._entries[i] = (weakref.ref(source, lambda ref, i=i: self._drop(i, ref)), {})
        e[1][kind] = (key, also, weakref.ref(value) if weak else value, weak)
        if not weak:
            self._held[kind] = i
        return value

    def clear(self, kind) -> None:
        """Drop the held value of ``kind`` (when a backward starts: the forward's copies are not read again)."""
        i = self._held.pop(kind, None)
        e = self._entries.get(i) if i is not None else None
        if e is not None:
            e[1].pop(kind, None)

    def _drop(self, i: int, ref) -> None:  # weakref callback: the source died (its id may be reused since)
        e = self._entries.get(i)
        if e is not None and e[0] is ref:
            del self._entries[i]


#: The package's cache (the Linear and the grouped GEMM read and clear their kinds of it).
OPERANDS = OperandCache()
