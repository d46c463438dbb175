"""The eager kernel launcher (``fp8tensor.kernels._Launcher``): the first launch of each argument class goes through
Triton's JIT, later ones call the compiled kernel directly with the arguments in signature order; anything Triton
specializes on (tensor dtype and 16-byte alignment, integer 1 / multiple of 16 / int32 range, constexpr values,
num_warps, device) starts a new class. Checked with a stand-in for the JIT function (no GPU needed); the real kernels
are checked bit for bit in tests/gpu."""
from __future__ import annotations

import types

import pytest
import torch

from fp8tensor import kernels

pytestmark = pytest.mark.skipif(not kernels._FAST_OK, reason="needs Triton >= 3.3")


class _Param:
    def __init__(self, name, constexpr, default=None):
        self.name, self.is_constexpr = name, constexpr
        self.has_default, self.default = default is not None, default


class _FakeJit:
    """Stands in for a ``@triton.jit`` function ``k(x_ptr, y_ptr, M, stride, BLOCK: constexpr, FLAG: constexpr=1)``."""

    def __init__(self):
        self.params = [_Param("x_ptr", False), _Param("y_ptr", False), _Param("M", False), _Param("stride", False),
                       _Param("BLOCK", True), _Param("FLAG", True, default=7)]
        self.jit_calls, self.runs = [], []
        jit = self

        class Compiled:
            function, packed_metadata = "fn", "md"

            def launch_metadata(self, grid, stream, *args):
                return None

            def run(self, *a):
                jit.runs.append(a)

        self.compiled = Compiled()

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            return self.compiled

        return call


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda idx: 1234, raising=False)
    monkeypatch.setattr(kernels, "_FAST_OK", True)
    return torch.device("cuda", 0)


def test_first_launch_jit_then_direct(fake_cuda):
    fn = _FakeJit()
    launch = kernels._Launcher(fn)
    buf = torch.zeros(256, dtype=torch.uint8)
    x, y = buf[:64], buf[64:128]  # 16-byte aligned offsets of an aligned allocation
    launch((3, 2), (x, y, 64, 32), dict(BLOCK=16), 4, fake_cuda)
    assert len(fn.jit_calls) == 1 and fn.runs == []
    grid, args, kwargs = fn.jit_calls[0]
    assert grid == (3, 2) and args == (x, y, 64, 32) and kwargs == dict(BLOCK=16, num_warps=4)
    launch((5, 2), (x, y, 96, 48), dict(BLOCK=16), 4, fake_cuda)  # same class: 96 and 48 are multiples of 16
    assert len(fn.jit_calls) == 1 and len(fn.runs) == 1
    r = fn.runs[0]
    assert r[:7] == (5, 2, 1, 1234, "fn", "md", None)
    assert r[9:] == (x, y, 96, 48, 16, 7)  # every argument in signature order, the constexpr default filled in


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int_one", "int_not16", "int64", "constexpr", "warps",
                                    "flag"])
def test_new_argument_class_goes_through_jit(fake_cuda, change):
    fn = _FakeJit()
    launch = kernels._Launcher(fn)
    buf = torch.zeros(512, dtype=torch.uint8)
    x, y = buf[:64], buf[64:128]
    args, consts, warps = [x, y, 64, 32], dict(BLOCK=16), 4
    launch((1,), tuple(args), consts, warps, fake_cuda)
    if change == "misaligned":
        args[0] = buf[1:65]
    elif change == "dtype":
        args[1] = torch.zeros(16, dtype=torch.float32)
    elif change == "int_one":
        args[2] = 1
    elif change == "int_not16":
        args[3] = 33
    elif change == "int64":
        args[2] = 2**33
    elif change == "constexpr":
        consts = dict(BLOCK=32)
    elif change == "warps":
        warps = 8
    elif change == "flag":
        consts = dict(BLOCK=16, FLAG=3)
    launch((1,), tuple(args), consts, warps, fake_cuda)
    assert len(fn.jit_calls) == 2 and fn.runs == []
    launch((1,), tuple(args), consts, warps, fake_cuda)  # and that class is cached in turn
    assert len(fn.jit_calls) == 2 and len(fn.runs) == 1


def test_triton_without_direct_entry_always_jit(fake_cuda, monkeypatch):
    """A Triton whose compiled kernels cannot be called directly (before 3.3): every launch through its JIT."""
    monkeypatch.setattr(kernels, "_FAST_OK", False)
    fn = _FakeJit()
    launch = kernels._Launcher(fn)
    x = torch.zeros(64, dtype=torch.uint8)
    for _ in range(3):
        launch((1,), (x, x, 64, 32), dict(BLOCK=16), 4, fake_cuda)
    assert len(fn.jit_calls) == 3 and fn.runs == []


def test_launch_hook_gets_metadata(fake_cuda, monkeypatch):
    """With a launch-enter hook installed (profilers), the compiled kernel's launch metadata is passed, as Triton's
    own ``run`` does."""
    from triton import knobs

    seen = []
    fn = _FakeJit()
    fn.compiled.launch_metadata = types.MethodType(lambda self, grid, stream, *a: seen.append(grid) or "meta",
                                                   fn.compiled)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    launch = kernels._Launcher(fn)
    x = torch.zeros(64, dtype=torch.uint8)
    launch((2,), (x, x, 64, 32), dict(BLOCK=16), 4, fake_cuda)
    launch((2,), (x, x, 64, 32), dict(BLOCK=16), 4, fake_cuda)
    assert seen == [(2,)] and fn.runs[0][6] == "meta"


def test_empty_hook_chains_pass_no_hooks(fake_cuda, monkeypatch):
    """Triton >= 3.5 keeps its launch hooks as chains, never None: with no hook in either chain the launch builds no
    launch metadata and passes no hooks (what the chains would call is nothing); a hook in either chain gets them."""
    from triton import knobs

    if kernels._HOOK_CHAIN is None:
        pytest.skip("Triton without hook chains")
    seen = []
    fn = _FakeJit()
    fn.compiled.launch_metadata = types.MethodType(lambda self, grid, stream, *a: seen.append(grid) or "meta",
                                                   fn.compiled)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", kernels._HOOK_CHAIN())
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", kernels._HOOK_CHAIN(reversed=True))
    launch = kernels._Launcher(fn)
    x = torch.zeros(64, dtype=torch.uint8)
    for _ in range(2):
        launch((2,), (x, x, 64, 32), dict(BLOCK=16), 4, fake_cuda)
    assert seen == [] and fn.runs[0][6:9] == (None, None, None)
    knobs.runtime.launch_exit_hook.add(lambda meta: None)
    launch((2,), (x, x, 64, 32), dict(BLOCK=16), 4, fake_cuda)
    r = fn.runs[-1]
    assert seen == [(2,)] and r[6] == "meta" and r[7] is knobs.runtime.launch_enter_hook
    assert r[8] is knobs.runtime.launch_exit_hook


def test_launch_consts_are_read_once_per_object(fake_cuda, monkeypatch):
    """A :class:`kernels.LaunchConsts` (the memoized launch plans') gives its constexprs once per object; another
    object of other values is another class; any other mapping (a dict, a read-only view of a dict that may change)
    is read on every call."""
    reads = []
    tail = kernels._Launcher._tail
    monkeypatch.setattr(kernels._Launcher, "_tail",
                        lambda self, n, consts: reads.append(consts) or tail(self, n, consts))
    fn = _FakeJit()
    launch = kernels._Launcher(fn)
    x = torch.zeros(64, dtype=torch.uint8)
    a, b = kernels.LaunchConsts(dict(BLOCK=16)), kernels.LaunchConsts(dict(BLOCK=16, FLAG=2))
    backing = dict(BLOCK=16)
    view = types.MappingProxyType(backing)
    for consts in (a, a, b, b, dict(BLOCK=16, FLAG=2), a, view):
        launch((1,), (x, x, 64, 32), consts, 4, fake_cuda)
    assert len(fn.jit_calls) == 2  # a's class, then b's (the dict is b's class, the view a's)
    assert [r[-2:] for r in fn.runs] == [(16, 7), (16, 2), (16, 2), (16, 7), (16, 7)]
    assert [id(c) for c in reads] == [id(a), id(b), id(reads[2]), id(view)] and reads[2] == dict(BLOCK=16, FLAG=2)
    backing["BLOCK"] = 32  # the view now shows other values: a new class, not a stale memo
    launch((1,), (x, x, 64, 32), view, 4, fake_cuda)
    assert len(fn.jit_calls) == 3 and fn.jit_calls[-1][2]["BLOCK"] == 32
    assert len(launch.tails) == 2
    with pytest.raises(TypeError):
        a["BLOCK"] = 32  # noqa: the mapping has no way to change
