"""A training step's forward + loss + backward captured once as a CUDA graph and replayed (:func:`graph_step`,
torchtitan's scheme; docs/cuda_graphs.md)."""
from __future__ import annotations

import operator
import warnings
from typing import Any, Callable, Iterable, Optional

import torch

from ..core import compat
from ..core.capture import begin_capture, end_capture

__all__ = ["GraphedStep", "graph_step"]


class _Value:
    """A non-tensor input leaf, compared by value where well defined (NaN equals NaN), else by identity."""

    __slots__ = ("v",)

    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        a, b = self.v, other.v
        if a is b:
            return True
        if type(a) is not type(b):
            return False
        if isinstance(a, float) and a != a and b != b:
            return True
        try:
            eq = a == b
            if isinstance(eq, bool):
                return eq
            # (numpy scalars and arrays compare to np.bool_ or an array of them: equal where the shapes match and
            # every element does)
            if getattr(a, "shape", None) != getattr(b, "shape", None):
                return False
            return bool(eq.all()) if hasattr(eq, "all") else bool(eq)
        except Exception:
            return False

    def __repr__(self):
        return f"{type(self.v).__name__} {self.v!r}"


def _storage_ptrs(t: torch.Tensor) -> tuple:
    """The storage addresses behind ``t``, through ``__tensor_flatten__`` for wrapper subclasses."""
    if hasattr(type(t), "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, n) for n in names)  # (torch >= 2.13 DTensor also lists its device_mesh: not a tensor)
        return tuple(ptr for v in inner if isinstance(v, torch.Tensor) for ptr in _storage_ptrs(v))
    return (t.untyped_storage().data_ptr(),)


def _members(m: torch.nn.Module) -> tuple:
    """``m``'s own parameters, buffers and child modules (None entries included)."""
    return (tuple(compat.parameters_dict(m).values()), tuple(compat.buffers_dict(m).values()),
            tuple(compat.children_dict(m).values()))


def _named_members(model: torch.nn.Module) -> dict:
    """``{"parameters": [(name, parameter)], "buffers": [...], "submodules": [...]}`` of ``model`` (for messages)."""
    return {"parameters": list(model.named_parameters(remove_duplicate=False)),
            "buffers": list(model.named_buffers(remove_duplicate=False)),
            "submodules": list(model.named_modules(remove_duplicate=False))[1:]}


class GraphedStep:
    """``fn(*args, **kwargs)`` (forward + loss + ``backward()``) captured as one CUDA graph; see :func:`graph_step`.
    Attributes: ``calls`` (so far), ``captured``, ``graph`` (the ``torch.cuda.CUDAGraph`` or None), ``pool`` (the graph
    memory pool handle, shareable through ``graph_step(..., pool=)``)."""

    def __init__(self, fn: Callable[..., Any], parameters: Iterable[torch.Tensor], *, warmup_steps: int = 3,
                 pool=None, enabled: Optional[bool] = None):
        if not callable(fn):
            raise TypeError(f"graph_step: fn must be callable, got {type(fn).__name__}")
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        self._module = parameters if isinstance(parameters, torch.nn.Module) else None
        if self._module is None and not hasattr(parameters, "__iter__"):
            raise TypeError(f"graph_step: parameters must be the model (an nn.Module) or an iterable of tensors "
                            f"(model.parameters()), got {type(parameters).__name__}")
        self.parameters = list(self._module.parameters() if self._module is not None else parameters)
        for i, p in enumerate(self.parameters):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"graph_step: parameters must be tensors (e.g. model.parameters()), item {i} is "
                                f"{type(p).__name__}")
        if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 1:
            raise ValueError(f"graph_step: warmup_steps must be an int >= 1 (compile and allocate before the capture), "
                             f"got {warmup_steps!r}")
        if enabled is not None and not isinstance(enabled, bool):
            raise TypeError(f"graph_step: enabled must be None, True or False, got {enabled!r}")
        if pool is not None and not (isinstance(pool, tuple) and all(isinstance(i, int) for i in pool)):
            raise TypeError("graph_step: pool must be a graph memory pool handle (torch.cuda.graph_pool_handle() or "
                            f"another step's .pool), got {type(pool).__name__}")
        self.fn = fn
        self.warmup_steps = warmup_steps
        self.enabled = enabled
        self._given_pool = pool
        self._reset()

    # ------------------------------------------------------------------------------------------------ state
    def _reset(self) -> None:
        self.calls = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self._capture = None
        self.pool = self._given_pool
        self._signature = None  # (treespec, leaf descriptions) of the first call
        self._static_leaves: list = []  # the graph's input tensors, in leaf order (None for non-tensor leaves)
        self._static_out = None
        self._stream: Optional[torch.cuda.Stream] = None
        self._watched: list = []  # (parameter, its gradient tensor at capture): the tensors the graph writes
        self._had_grad: list = []  # parameters that had a gradient after the last warm-up call
        self._requires_grad: list = []  # (parameter, its requires_grad at capture): which gradients the graph computes
        self._memory: list = []  # (parameter or buffer, its storage addresses at capture): the memory the graph reads
        self._tree: list = []  # (module, its parameters, buffers, children) of the model at capture (model given)
        self._names: dict = {}  # {"parameters" / "buffers" / "submodules": [(name, object)]} of the model at capture
        self._eager = False  # decided on the first call: capture impossible here (CPU), run fn eagerly

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def close(self) -> None:
        """Release the graph, its memory pool (unless shared) and the static inputs and outputs, and re-read the
        model's parameters; the next call starts again with warm-up calls (e.g. after changing the batch shape)."""
        if self.graph is not None and torch.cuda.is_available():
            torch.cuda.synchronize()
        if self._module is not None:
            self.parameters = list(self._module.parameters())  # the model's parameters of now
        self._reset()

    def __enter__(self) -> "GraphedStep":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ calls
    def __call__(self, *args, **kwargs):
        if self.enabled is False:  # always eager, no contract
            self.calls += 1
            return self.fn(*args, **kwargs)
        leaves, spec = compat.tree_flatten((args, kwargs))
        desc = tuple(("tensor", tuple(t.shape), t.dtype, t.device, t.requires_grad) if isinstance(t, torch.Tensor)
                     else ("value", _Value(t)) for t in leaves)  # what must stay the same between calls
        if self.calls == 0:
            self._eager = not self._can_capture(leaves)
            self._signature = (spec, desc)
        elif (spec, desc) != self._signature:
            raise ValueError(
                "graph_step: the inputs changed structure, shape, dtype, device or a non-tensor value since the "
                f"first call ({self._first_difference(spec, desc)}); a captured CUDA graph replays fixed shapes. "
                "Pad batches to one shape, or call close() to warm up and capture again for the new inputs")
        self.calls += 1
        if self._eager:  # no capture possible here: run eagerly, under the same contract as the graph
            return self._eager_call(args, kwargs)
        if self.calls <= self.warmup_steps:
            return self._warmup(args, kwargs)
        if self.graph is None:
            return self._capture_and_replay(leaves, spec)
        self._check_memory()
        self._check_grads()
        for static, leaf in zip(self._static_leaves, leaves):
            if static is not None and static is not leaf:
                static.copy_(leaf)
        self.graph.replay()
        return self._static_out

    def _eager_call(self, args, kwargs):
        """The eager fallback, under the graph's contract: a loop that runs on the CPU also runs captured."""
        if self.calls == self.warmup_steps + 1:
            self._prepare_grads()
        elif self.calls > self.warmup_steps + 1:
            self._check_memory()
            self._check_grads()
        try:
            out = self.fn(*args, **kwargs)
        except BaseException:
            if self.calls == self.warmup_steps + 1:  # as a failed capture: no snapshot taken, the next call takes it
                self.calls -= 1
            raise
        if self.calls <= self.warmup_steps:
            self._had_grad = [p for p in self.parameters if p.grad is not None]
        elif self.calls == self.warmup_steps + 1:  # the snapshot after the call, as a capture takes it
            self._record_memory()
        return out

    def _prepare_grads(self) -> None:
        # gradients must exist before the capture: one None then would be assigned a tensor of the graph's pool
        with torch.no_grad():
            for p in self._had_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)

    def _can_capture(self, leaves) -> bool:
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)] + self.parameters
        if not torch.cuda.is_available():
            why = "CUDA is not available"
        elif any(t.device.type != "cuda" for t in tensors):
            why = "an input or parameter is not on a CUDA device"
        else:
            return True
        if self.enabled:
            raise RuntimeError(f"graph_step: cannot capture a CUDA graph: {why} (pass enabled=None to run eagerly)")
        warnings.warn(f"graph_step: {why}; running the step eagerly (no CUDA graph)", RuntimeWarning, stacklevel=3)
        return False

    def _first_difference(self, spec, desc) -> str:
        old_spec, old_desc = self._signature
        if spec != old_spec:
            return f"argument structure {old_spec} -> {spec}"
        for i, (a, b) in enumerate(zip(old_desc, desc)):
            if a != b:
                return f"input leaf {i}: {a[1:]} -> {b[1:]}"
        return "unknown"

    def _warmup(self, args, kwargs):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        main = torch.cuda.current_stream()
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            out = self.fn(*args, **kwargs)
        main.wait_stream(self._stream)
        for t in compat.tree_leaves(out):  # made on the side stream, used (and freed) on the caller's stream
            if isinstance(t, torch.Tensor):
                t.record_stream(main)
        self._had_grad = [p for p in self.parameters if p.grad is not None]
        return out

    def _capture_and_replay(self, leaves, spec):
        self._prepare_grads()
        self._static_leaves = [t.detach().clone() if isinstance(t, torch.Tensor) else None for t in leaves]
        static_args, static_kwargs = compat.tree_unflatten(
            [s if s is not None else leaf for s, leaf in zip(self._static_leaves, leaves)], spec)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        self._stream.wait_stream(torch.cuda.current_stream())
        torch.cuda.synchronize()
        cap = begin_capture(self._stream)
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self._stream):
                out = self.fn(*static_args, **static_kwargs)
        except Exception as e:
            end_capture(cap)
            self._reset()
            raise RuntimeError(
                f"graph_step: capturing the step as a CUDA graph failed ({type(e).__name__}: {e}). Inside the step "
                "nothing may synchronize with the host (.item(), .cpu(), printing a tensor, "
                "clip_grad_norm_(error_if_nonfinite=True), data-dependent shapes such as nonzero) or use CPU "
                "tensors; the optimizer step belongs outside. Pass enabled=False to run the step eagerly. A failed "
                "capture can leave PyTorch's CUDA random number generator unusable in this process: restart it") from e
        end_capture(cap)
        self.graph, self._capture = graph, cap  # (cap: what the graph reads at each replay, freed with it)
        self._static_out = out
        self._record_memory()
        graph.replay()
        return out

    def _record_memory(self) -> None:
        """Snapshot what the graph reads and writes: gradients, storages, and (model given) buffers and members."""
        self._watched = [(p, p.grad) for p in self.parameters if p.grad is not None]
        self._requires_grad = list({id(p): (p, p.requires_grad) for p in self.parameters}.values())
        tensors = list(self.parameters)
        self._tree, self._names = [], {}
        if self._module is not None:
            tensors += [b for b in self._module.buffers() if b is not None]
            self._tree = [(m, _members(m)) for m in self._module.modules()]
            self._names = _named_members(self._module)
        self._memory = [(t, _storage_ptrs(t)) for t in tensors]

    def _check_memory(self) -> None:
        flipped = [p for p, rg in self._requires_grad if p.requires_grad is not rg]
        if flipped:
            names = [n for n, t in self._names.get("parameters", ()) if any(t is p for p in flipped)]
            more = f" and {len(names) - 4} more" if len(names) > 4 else ""
            shown = f" ({', '.join(names[:4])}{more})" if names else ""
            raise RuntimeError(
                f"graph_step: requires_grad of {len(flipped)} of {len(self._requires_grad)} parameters{shown} changed "
                "after the capture (p.requires_grad_(...)); the captured backward computes the gradients it computed "
                "then, so a parameter frozen since would keep receiving gradients (and an optimizer keep training it) "
                "and one unfrozen since would get none. Freeze or unfreeze before the first call, or call close() to "
                "warm up and capture again")
        moved = [t for t, ptrs in self._memory if _storage_ptrs(t) != ptrs]
        replaced = {}
        # (identities only, no names walk: a tensor's == is elementwise)
        if any(not all(len(x) == len(y) and all(map(operator.is_, x, y)) for x, y in zip(members, _members(m)))
               for m, members in self._tree):
            now = _named_members(self._module)
            for kind, then in self._names.items():
                a, b = dict(then), dict(now[kind])
                names = sorted(n for n in a.keys() | b.keys() if a.get(n) is not b.get(n))
                if names:
                    replaced[kind] = names
        if moved or replaced:
            what = []
            if moved:
                what.append(f"{len(moved)} of {len(self._memory)} parameters{' and buffers' if self._tree else ''} "
                            "now live in other memory (model.to(...), p.data = ...)")
            for kind, names in replaced.items():
                shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
                how = {"parameters": "load_state_dict(..., assign=True), module.weight = ...",
                       "buffers": "module.some_buffer = ...", "submodules": "model.layer = ..."}[kind]
                what.append(f"{kind} {shown} were replaced in their modules ({how})")
            raise RuntimeError(
                f"graph_step: {'; '.join(what)} after the capture; the captured graph reads and writes the memory "
                "of the capture, so the step would silently train stale tensors. Update parameters in place "
                "(optimizer steps, load_state_dict without assign, p.copy_), or call close() to warm up and capture "
                "again over the current parameters")

    def _check_grads(self) -> None:
        for p, g in self._watched:
            if p.grad is not g:
                n = sum(1 for q, h in self._watched if q.grad is not h)
                what = "set to None" if p.grad is None else "replaced by other tensors"
                raise RuntimeError(
                    f"graph_step: the gradients of {n} of {len(self._watched)} parameters were {what} after the "
                    "capture; the captured backward writes into the gradient tensors that existed then, so training "
                    "would silently read stale memory. Zero them in place: optimizer.zero_grad(set_to_none=False) "
                    "(and model.zero_grad(set_to_none=False)); never assign p.grad. To start over, call close()")


def graph_step(fn: Callable[..., Any], parameters: Iterable[torch.Tensor], *, warmup_steps: int = 3, pool=None,
               enabled: Optional[bool] = None) -> GraphedStep:
    """Turn ``fn(*inputs) -> loss`` (forward, loss and ``loss.backward()``) into a step captured as one CUDA graph: a
    :class:`GraphedStep`, called like ``fn``.

    Method: torchtitan's whole-step CUDA graph (``torchtitan/distributed/cudagraph.py``): ``warmup_steps`` eager
    calls on a side stream, one capture into a graph memory pool, then replays on copied inputs (docs/cuda_graphs.md)::

        step = fp8tensor.graph_step(fwd_bwd, model)
        for x, y in batches:
            loss = step(x, y)                     # graph-owned: read or clone it before the next call
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

    Contract (docs/cuda_graphs.md, "Contract"): static inputs (structure, shapes, dtypes, devices, values);
    gradients zeroed in place; graph-owned outputs; parameters updated in place; no host synchronization in ``fn``.

    Args:
        fn: the step: forward, loss, ``backward()``; returns anything (graph-owned after capture).
        parameters: the model (``nn.Module``: replaced members and moved buffers detected) or the parameters whose
            gradients ``fn`` computes.
        warmup_steps: eager calls before the capture (>= 1; compiled blocks need one per compile).
        pool: a graph memory pool handle (``torch.cuda.graph_pool_handle()`` or another step's ``.pool``) to share.
        enabled: ``None`` (default): capture on CUDA, else run eagerly under the same contract with a
            ``RuntimeWarning``; ``True``: raise where capture cannot work; ``False``: always eager, no checks.

    Raises:
        TypeError / ValueError: bad arguments at construction, or changed inputs at a call.
        RuntimeError: the capture failed; after it, gradients were set to ``None`` or replaced, parameters (or
            buffers) moved, or members replaced; or ``enabled=True`` where capture is impossible.
    """
    return GraphedStep(fn, parameters, warmup_steps=warmup_steps, pool=pool, enabled=enabled)
