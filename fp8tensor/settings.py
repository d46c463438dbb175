"""The knobs of fp8tensor, in one place: :class:`Config`, read with :func:`get_config`, set process-wide with
:func:`set_config`, and scoped to a block (in the current thread) with :func:`config`::

    import fp8tensor

    with fp8tensor.config(unknown_ops="raise"):     # fail on any op without an fp8 implementation
        model(x)
    fp8tensor.set_config(gemm_backend="emulated")   # process-wide

Knobs are read when an op runs or is traced: a compiled graph keeps what was in force when it was traced.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator

__all__ = ["Config", "config", "get_config", "set_config", "GEMM_BACKENDS", "UNKNOWN_OPS"]  # public as fp8tensor.*

#: GEMM backends (see :mod:`fp8tensor.gemm`): ``auto`` picks row-wise ``torch._scaled_mm`` where the device supports
#: it, else tensor-wise with the row scales applied to the output, else an emulation in high precision.
GEMM_BACKENDS = ("auto", "rowwise", "tensorwise", "emulated")
#: What an op without an fp8 implementation does on a ``ScaledFp8Tensor`` (out-of-place ops only; in-place ops,
#: ``out=`` and collectives always raise): ``warn`` runs it on the dequantized tensors and warns once per op,
#: ``raise`` raises ``NotImplementedError``, ``allow`` runs it dequantized silently.
UNKNOWN_OPS = ("warn", "raise", "allow")


@dataclasses.dataclass(frozen=True)
class Config:
    """fp8tensor's settings (immutable; change them with :func:`set_config` or :func:`config`).

    Attributes:
        gemm_backend: one of :data:`GEMM_BACKENDS` (default ``"auto"``).
        unknown_ops: one of :data:`UNKNOWN_OPS` (default ``"warn"``): an out-of-place op that fp8tensor does not
            implement in fp8 runs in high precision on the dequantized tensors (correct, but a missing fp8 op looks
            like a working one, hence the warning; ``"raise"`` is for tests that must prove a path stays in fp8).
    """

    gemm_backend: str = "auto"
    unknown_ops: str = "warn"

    def __post_init__(self):
        _check_choice("gemm_backend", self.gemm_backend, GEMM_BACKENDS)
        _check_choice("unknown_ops", self.unknown_ops, UNKNOWN_OPS)


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"fp8tensor.config: unknown {name} {value!r}; expected one of {choices}")


_global = Config()
_local = threading.local()


def get_config() -> Config:
    """The settings in force in this thread: the innermost :func:`config` block, else the process-wide ones."""
    return getattr(_local, "config", None) or _global


def set_config(**changes) -> Config:
    """Change the process-wide settings (fields of :class:`Config`); returns the new settings.

    Raises:
        TypeError: an unknown field. ValueError: an unknown value.
    """
    global _global
    _global = _replace(_global, changes)
    return _global


@contextlib.contextmanager
def config(**changes) -> Iterator[Config]:
    """Scope changed settings (fields of :class:`Config`) to a ``with`` block in the current thread.

    Raises:
        TypeError: an unknown field. ValueError: an unknown value.
    """
    prev = getattr(_local, "config", None)
    new = _replace(prev or _global, changes)
    _local.config = new
    try:
        yield new
    finally:
        _local.config = prev


def _replace(base: Config, changes: dict) -> Config:
    names = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise TypeError(f"fp8tensor.config: unknown setting(s) {unknown}; settings are {sorted(names)}")
    return dataclasses.replace(base, **changes)
