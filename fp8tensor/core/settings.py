"""The knobs of fp8tensor: :class:`Config`, read with :func:`get_config`, set process-wide with :func:`set_config`,
scoped to a ``with`` block of the current thread with :func:`config`; read when an op runs or is traced (docs/design.md,
"Settings and tracing state")."""
from __future__ import annotations

import dataclasses
import threading
import weakref

import torch

__all__ = ["Config", "config", "get_config", "set_config", "GEMM_BACKENDS", "UNKNOWN_OPS",
           "COMPILED_QUANTIZATION", "STATE_DICT_FP8"]  # public as fp8tensor.*

#: GEMM backends (see :mod:`fp8tensor.gemm`): ``auto`` picks row-wise ``torch._scaled_mm`` where supported, else
#: tensor-wise, else an emulation in high precision.
GEMM_BACKENDS = ("auto", "rowwise", "tensorwise", "emulated")
#: What an out-of-place op without an fp8 implementation does on a ``ScaledFp8Tensor``: ``warn`` runs it dequantized
#: and warns once per op, ``raise`` raises ``NotImplementedError``, ``allow`` runs it dequantized silently. A view op
#: without one raises under ``warn`` and ``raise`` (writes through a view of dequantized values would be lost); under
#: ``allow`` it returns a view of a dequantized copy (read it; writes through it do not reach the tensor).
UNKNOWN_OPS = ("warn", "raise", "allow")
#: How compiled graphs quantize the grad_weight GEMMs' token-dim operands (see :attr:`Config.compiled_quantization`).
COMPILED_QUANTIZATION = ("kernels", "inductor")
#: What ``state_dict()`` of a ``quantize_weights`` model holds for an fp8 weight (see :attr:`Config.state_dict_fp8`).
STATE_DICT_FP8 = ("subclass", "plain")


@dataclasses.dataclass(frozen=True)
class Config:
    """fp8tensor's settings (immutable; change them with :func:`set_config` or :func:`config`).

    Every field but ``gemm_backend``, ``weight_only_decode`` and the ``size_rule*`` fields chooses between code paths
    computing the same bits (to measure one against the other, or to rule a fast path out).

    Attributes:
        gemm_backend: one of :data:`GEMM_BACKENDS` (default ``"auto"``).
        unknown_ops: one of :data:`UNKNOWN_OPS` (default ``"warn"``): what an out-of-place op without an fp8
            implementation does (it runs on the dequantized tensors; ``"raise"`` proves a path stays in fp8). A view
            op without one raises unless ``"allow"`` (then: a view of a dequantized copy, for reading).
        weight_only_decode: (default True) with autograd off, a decode-sized input (up to 64 tokens; bf16 / fp16,
            CUDA with Triton) of a per-row fp8 weight takes the small-M GEMM of
            :func:`fp8tensor.quantize.decode_mm`, split over K: up to 16 tokens multiplied in its own precision by
            the fp8 weight (no activation rounding), up to 64 quantized per row to e4m3 and multiplied fp8 x fp8.
            False: the same GEMM as training and ``torch.export`` (cuBLAS's row-scaled fp8 GEMM).
        compiled_quantization: one of :data:`COMPILED_QUANTIZATION` (default ``"kernels"``): how a compiled graph
            quantizes the token-dim operands of the grad_weight GEMMs: fp8tensor's Triton kernels, or torch ops that
            inductor may fuse into their producers. (The Linear's; the MoE grouped GEMMs' per-group column operands
            always take fp8tensor's kernel on CUDA: their plain ops measured several times slower.)
        grouped_gemm_kernel: (default True) fp8 grouped GEMMs (MoE) run ``torch._scaled_grouped_mm`` where it exists
            (CUDA, e4m3, dims multiples of 16); False: the per-group ``torch._scaled_mm`` loop (the CPU path).
        size_rule: (default False) whether :func:`fp8tensor.convert_to_fp8` applies the size-aware choice
            :func:`fp8tensor.recipes.fp8_size_choice` when its ``size_rule`` argument is None.
        size_rule_min: (default 640) the size rule's threshold on ``K * N / (K + N)``: below it a Linear stays in
            high precision (calibrate with ``benchmarks/linear.py --size-rule``). A positive number.
        size_rule_fp8_grad_weight_min: (default 1024) a ``rowwise`` Linear whose ``K * N / (K + N)`` lies in
            ``[size_rule_min, size_rule_fp8_grad_weight_min)`` gets ``rowwise_gw_hp``. A positive number; at most
            ``size_rule_min`` turns this middle tier off.
        fp8_all_gather_min_numel: (default 2**27) where :func:`fp8tensor.convert_to_fp8`'s ``fp8_all_gather=None``
            rule picks the bf16 all-gather (one host), a weight of at least this many elements is still all-gathered
            in fp8 (it saves more GPU time than the hooks cost the host; docs/fsdp.md). A positive integer.
        state_dict_fp8: one of :data:`STATE_DICT_FP8` (default ``"subclass"``): what ``state_dict()`` of a
            :func:`fp8tensor.quantize_weights` model holds per fp8 weight: the :class:`ScaledFp8Tensor`, or
            ``"plain"`` ``weight`` (fp8) + ``weight_scale`` (float32 ``(out_features, 1)``), the safetensors / Hugging
            Face layout (:mod:`fp8tensor.checkpoint`). Loading accepts both.
    """

    gemm_backend: str = "auto"
    unknown_ops: str = "warn"
    weight_only_decode: bool = True
    compiled_quantization: str = "kernels"
    grouped_gemm_kernel: bool = True
    size_rule: bool = False
    size_rule_min: float = 640
    size_rule_fp8_grad_weight_min: float = 1024
    fp8_all_gather_min_numel: int = 2**27
    state_dict_fp8: str = "subclass"

    def __post_init__(self):
        for name, choices in (("gemm_backend", GEMM_BACKENDS), ("unknown_ops", UNKNOWN_OPS),
                              ("compiled_quantization", COMPILED_QUANTIZATION), ("state_dict_fp8", STATE_DICT_FP8)):
            if getattr(self, name) not in choices:
                raise ValueError(f"fp8tensor.config: unknown {name} {getattr(self, name)!r}; expected one of {choices}")
        for name in ("weight_only_decode", "grouped_gemm_kernel", "size_rule"):
            value = getattr(self, name)
            if type(value) is not bool:
                raise ValueError(f"fp8tensor.config: {name} must be True or False, got {value!r}")
        for name in ("size_rule_min", "size_rule_fp8_grad_weight_min"):
            m = getattr(self, name)
            if type(m) not in (int, float) or not (0 < m < float("inf")):
                raise ValueError(f"fp8tensor.config: {name} must be a positive finite number, got {m!r}")
        n = self.fp8_all_gather_min_numel
        if type(n) is not int or n < 1:
            raise ValueError(f"fp8tensor.config: fp8_all_gather_min_numel must be a positive integer, got {n!r}")


#: The settings a compiled graph bakes in that dynamo does not see read: the GEMM backend, the unknown-op policy and
#: the compiled quantization are read inside the subclass's dispatch and the autograd Function while AOTAutograd
#: traces, below dynamo (see :func:`read_traced_settings`).
TRACED_SETTINGS = ("gemm_backend", "unknown_ops", "weight_only_decode", "compiled_quantization", "grouped_gemm_kernel")


_global = Config()
class _ThreadState(threading.local):
    """This thread's :func:`config` state. Every field is set on the instance in each thread (``__init__`` runs in a
    thread at its first access), never left to a class-level default: reading one is a plain attribute lookup
    (``getattr(local, name, None)`` of a missing one raises and catches inside: µs per call, on every Linear call),
    and ``torch.compile`` guards on it. A graph traced while a field was still the class's default was guarded on the
    field's absence from the thread-local ``__dict__``, a guard that later blocks did not fail: a model compiled before
    the thread's first ``config`` block ignored every block entered around its later calls."""

    def __init__(self):
        self.block = None  # (overrides, the global settings they were merged with, merged) or None
        self.stack = []  # the enclosing blocks' (scope, changes), innermost last
        self.pending = []  # weak references to blocks made and not entered yet, reported at the next read (as
        # ``[]`` from the start: a graph guards on it, and None -> [] at the first block would recompile it)


_local = _ThreadState()


def get_config() -> Config:
    """The settings in force in this thread: the enclosing :func:`config` blocks' fields over the process-wide ones."""
    if _local.pending:
        _raise_pending()
    block = _local.block
    if block is None:
        return _global
    overrides, base, merged = block
    if base is not _global:  # set_config ran since: merge the block's fields into the new process-wide settings
        merged = dataclasses.replace(_global, **overrides)
        # Cached in eager only: under torch.compile this write would be a side effect inside a traced
        # autograd.Function (the fp8 Linear's forward reads the settings on CUDA), and dynamo then rejects the
        # saved fp8 operand ("intermediate tensor ... aliases an input or output").
        if not torch.compiler.is_compiling():
            _local.block = (overrides, _global, merged)
    return merged


def traced_settings() -> tuple:
    """The values of :data:`TRACED_SETTINGS` in force in this thread (for keys of compiled code, e.g. the
    AOTAutograd cache key of fp8tensor's subclasses)."""
    cfg = get_config()
    return tuple(getattr(cfg, name) for name in TRACED_SETTINGS)


def read_traced_settings() -> bool:
    """Compare every field of :data:`TRACED_SETTINGS` of :func:`get_config` with its default; returns whether all
    are defaults. Called from the fp8 Linear and grouped GEMM entry points under ``torch.compile``: dynamo installs a
    guard on a value where traced code compares it (not where it is only read), so a later ``set_config`` or
    ``config`` block that changes one recompiles instead of running a graph traced under the old value."""
    cfg = get_config()
    values = (cfg.gemm_backend, cfg.unknown_ops, cfg.weight_only_decode, cfg.compiled_quantization,
              cfg.grouped_gemm_kernel)
    return values == ("auto", "warn", True, "kernels", True)  # (a literal: no guard of its own)


def scope_token():
    """This thread's :func:`config` blocks as an opaque token for :func:`swap_scope` (None outside any): the fp8
    Linear's backward runs under its forward's (autograd's device threads). It holds settings, not scopes."""
    block = getattr(_local, "block", None)
    return None if block is None else (block, tuple((None, changes) for _, changes in _local.stack or ()))


def swap_scope(token):
    """Make ``token`` (from :func:`scope_token` or this function) this thread's :func:`config` blocks; returns the
    previous state."""
    prev = (getattr(_local, "block", None), tuple(getattr(_local, "stack", None) or ()))
    _local.block, stack = (None, ()) if token is None else token
    _local.stack = list(stack)
    return prev


def _apply_stack() -> None:
    """This thread's settings block from its entered scopes (in the order entered; a later one wins a field)."""
    stack = getattr(_local, "stack", None)
    if not stack:
        _local.block = None
        return
    overrides: dict = {}
    for _, changes in stack:
        overrides.update(changes)
    _local.block = (overrides, _global, _replace(_global, overrides))


def set_config(**changes) -> Config:
    """Change the process-wide settings (fields of :class:`Config`); returns them. Fields a :func:`config` block
    names keep the block's values inside it.

    Raises ``TypeError`` (an unknown field) or ``ValueError`` (an unknown value).
    """
    global _global
    if getattr(_local, "pending", None):
        _raise_pending()
    _global = _replace(_global, changes)
    return _global


class _Scope:
    """What :func:`config` returns: a context manager whose settings hold inside its ``with`` block (recorded weakly
    until entered)."""

    __slots__ = ("changes", "pending", "__weakref__")

    def __init__(self, changes: dict):
        self.changes = changes
        self.pending = None  # (the creating thread's pending list and this scope's entry in it, until entered)

    def __enter__(self) -> Config:
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        if any(sc is self for sc, _ in stack):
            raise RuntimeError("fp8tensor.config(...): this block is already entered; make a new one to nest")
        if self.pending is not None:  # entered: no longer pending in the thread that made it (maybe not this one)
            owner, ref = self.pending
            self.pending = None
            try:
                owner.remove(ref)  # (atomic: the owner thread may append to its list meanwhile)
            except ValueError:
                pass
        stack.append((self, self.changes))
        _apply_stack()
        return _local.block[2]

    def __exit__(self, *exc) -> None:
        stack = getattr(_local, "stack", None) or []
        stack[:] = [(sc, ch) for sc, ch in stack if sc is not self]
        _apply_stack()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.changes.items())
        return f"fp8tensor.config({args})"


def config(**changes) -> _Scope:
    """Scope changed settings (fields of :class:`Config`) to a ``with`` block in the current thread; blocks nest::

        with fp8tensor.config(gemm_backend="emulated") as cfg:   # cfg: the Config in force inside
            model(x)

    The result must be entered (``with``) before the thread's next fp8tensor operation (in this thread or another;
    its settings hold in the thread that enters it). A compiled converted Linear or grouped-experts module recompiles
    when a block changes a setting its graph was traced under; fp8 tensors used directly in compiled code (``x @
    w.t()``) keep the settings of the trace.

    Raises:
        TypeError: an unknown field. ValueError: an unknown value (both when called, before any ``with``).
        RuntimeError: the result (or an earlier one) was not used with ``with`` (at the thread's next operation).
    """
    pending = getattr(_local, "pending", None)
    if pending is None:
        pending = _local.pending = []
    elif any(r() is None for r in pending):  # an earlier scope died without being entered
        _raise_pending()
    _replace(_global, changes)  # validates now
    scope = _Scope(changes)
    ref = weakref.ref(scope)
    scope.pending = (pending, ref)
    pending.append(ref)
    return scope


def _raise_pending() -> None:
    """Raise: a :func:`config` scope of this thread was made and not entered (reported once)."""
    scopes = [repr(s) for s in (r() for r in _local.pending) if s is not None]
    _local.pending.clear()
    which = f" ({', '.join(scopes)}, not entered yet)" if scopes else ""
    raise RuntimeError(
            f"fp8tensor.config(...) was called without `with`{which}, so its settings never took effect: write "
            "`with fp8tensor.config(...):` around the code it applies to, or call fp8tensor.set_config(...) for "
            "process-wide settings")


def _replace(base: Config, changes: dict) -> Config:
    names = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise TypeError(f"fp8tensor.config: unknown setting(s) {unknown}; settings are {sorted(names)}")
    return dataclasses.replace(base, **changes)
