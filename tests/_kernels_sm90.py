"""Compile every Triton kernel launch of the interpreter tests for an H100/H200 (sm_90) without a GPU.

The interpreter tests (``tests/_*_interp.py``) run fp8tensor's kernels on the CPU, which checks their arithmetic but
not that Triton's CUDA compiler takes them (the interpreter accepts code the compiler rejects, and the other way
round). It records each distinct launch (kernel, argument types, pointer alignment, constexpr values, warps, stages) that
the package's launch functions make with their tile tables at the benchmarks' shapes (from meta tensors, with the
launchers replaced by a recorder), then, with a stand-in driver that names an sm_90 target, gives each to Triton's
``JITFunction.warmup`` (Triton's own binder and specialization, then its CUDA compiler down to a cubin through
``ptxas``), launching nothing. It prints one line per distinct kernel build with its registers and stack (spills).

* ``python tests/_kernels_sm90.py``: the package's launches (tests/test_kernels_sm90.py; no interpreter, so any
  Triton with its NVIDIA backend, the GPU image's included);
* ``TRITON_INTERPRET=1 python tests/_kernels_sm90.py record OUT SEED``, then ``python tests/_kernels_sm90.py OUT``:
  also the launches of the interpreter tests (``tests/_*_interp.py``; other tiles, unaligned shapes)."""
import importlib
import json
import re
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SCRIPTS = ("_kernels_interp", "_group_cols_interp", "_w8_mm_interp")


def _spec(v):
    import triton.language as tl

    if isinstance(v, torch.Tensor):
        return ["tensor", str(v.dtype).removeprefix("torch."), v.data_ptr() % 16 == 0]
    if isinstance(v, bool):
        return ["bool", v]
    if isinstance(v, int):
        return ["int", v]
    if isinstance(v, float):
        return ["float", v]
    if isinstance(v, tl.dtype):
        return ["tl.dtype", str(v)]
    if v is None:
        return ["none"]
    raise TypeError(f"unrecorded argument type {type(v)}")


def record(out: str, seed: int) -> None:
    from triton.runtime.interpreter import InterpretedFunction

    seen, launches = set(), []
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        entry = dict(kernel=f"{self.fn.__module__}:{self.fn.__name__}", args=[_spec(a) for a in args],
                     kwargs={k: _spec(v) for k, v in sorted(kwargs.items())})
        key = json.dumps(entry, sort_keys=True)
        if key not in seen:
            seen.add(key)
            launches.append(entry)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    sys.path.insert(0, str(HERE))
    for name in SCRIPTS:
        if (HERE / f"{name}.py").exists():
            _run_main(name, seed)
    InterpretedFunction.run = run
    Path(out).write_text(json.dumps(launches, indent=1))
    print(f"recorded {len(launches)} launches")


def _record_package_tiles(seen: set, launches: list) -> None:
    """The launches the package's own launch functions make with their tile tables, at the shapes of the benchmarks
    (Llama3-8B's, dims 2048-8192, the MoE layers'), recorded from meta tensors without running anything."""
    from fp8tensor.numerics import kernels as K

    def recorder(fn):
        def launch(grid, args, consts, num_warps, device, num_stages=None, *, traced=False):
            opts = dict(num_warps=num_warps) if num_stages is None else dict(num_warps=num_warps,
                                                                            num_stages=num_stages)
            entry = dict(kernel=f"{fn.fn.__module__}:{fn.fn.__name__}", args=[_spec(a) for a in args],
                         kwargs={k: _spec(v) for k, v in sorted({**consts, **opts}.items())})
            key = json.dumps(entry, sort_keys=True)
            if key not in seen:
                seen.add(key)
                launches.append(entry)
        return launch

    K._launch = lambda fn, grid, args, consts, num_warps, device, num_stages=None, *, traced=False: recorder(fn)(
        grid, args, consts, num_warps, device, num_stages)
    K._launcher = recorder
    K._SM_COUNT[-1] = 132  # an H200's SMs: the decode GEMM's K split as on the GPU
    meta = torch.device("meta")
    e4m3 = torch.float8_e4m3fn
    for dtype in (torch.bfloat16, torch.float32):
        for M, Kd in ((8192, 2048), (8192, 4096), (8192, 8192), (16384, 14336), (100, 70)):
            x = torch.empty(M, Kd, dtype=dtype, device=meta)
            K.launch_dim0_t(x, e4m3, 1e-12)
            K.launch_both(x, e4m3, 1e-12)
            K.quantize_last_dim(x, e4m3, 1e-12, checked=True)
            K.quantize_last_dim(x, e4m3, 1e-12, checked=True, col_scale=torch.empty(Kd, device=meta))
            for G in (1, 8, 128):  # grouped multipliers (fp8 expert weights' row scales folded into grad_out)
                K.quantize_last_dim(x, e4m3, 1e-12, checked=True, col_scale=torch.empty(G, Kd, device=meta),
                                    col_scale_ends=torch.empty(G, dtype=torch.int32, device=meta))
        for Kd in (1024, 5000, 8192, 28672):  # the row-wise kernel's plans: whole rows (up to 8192), two reads past
            K.quantize_last_dim(torch.empty(4096, Kd, dtype=dtype, device=meta), e4m3, 1e-12, checked=True)
    K._device_table = lambda values, device: torch.empty(len(values), dtype=torch.int64, device=meta)
    K._launch_group([torch.empty(64, 64, dtype=torch.bfloat16, device=meta)], [0], [0], e4m3, 1e-12)
    K.launch_transpose(torch.empty(4096, 1024, dtype=e4m3, device=meta))
    for dtype in (torch.bfloat16, torch.float32):  # a master expert weight re-cast for grad_input
        K.launch_cast_rows_t(torch.empty(8, 2048, 7168, dtype=dtype, device=meta), torch.empty(8, 2048, device=meta),
                             e4m3)
    for mode in ("one_kernel", "split"):
        saved = K.GROUP_COL_CONFIG
        K.GROUP_COL_CONFIG = K._frozen({**saved, "mode": mode})
        try:
            for M, C, G in ((16384, 7168, 8), (65536, 768, 128)):
                x = torch.empty(M, C, dtype=torch.bfloat16, device=meta)
                ends = torch.empty(G, dtype=torch.int32, device=meta)
                for align, pad in ((16, 16), (1, 0)):
                    K.launch_group_cols_t(x, ends, ends, torch.empty(G * C * M, dtype=e4m3, device=meta),
                                          torch.empty(G, C, device=meta), stride_qg=C * M, stride_qc=M, q_cols=M,
                                          align=align, float8_dtype=e4m3, scale_floor=1e-12, min_pad=pad)
        finally:
            K.GROUP_COL_CONFIG = saved
    for dtype in (torch.bfloat16, torch.float16):
        for M in sorted({1, *K.W8_MM_CONFIG["tiles"]}):
            for N, Kd in ((6144, 4096), (4096, 4096), (14336, 4096), (4096, 14336)):
                for bias in (None, torch.empty(N, dtype=dtype, device=meta)):
                    for one in (True, False):  # (eager outside capture: one launch; captured: the split's two)
                        K.launch_w8_mm(torch.empty(M, Kd, dtype=dtype, device=meta),
                                       torch.empty(N, Kd, dtype=e4m3, device=meta), torch.empty(N, 1, device=meta),
                                       bias, one_launch=one)
                    if bias is None and K.w8_mm_split(M, N, Kd, meta) > 1:  # the traced K split's partial sums
                        K.launch_w8_mm_partials(torch.empty(M, Kd, dtype=dtype, device=meta),
                                                torch.empty(N, Kd, dtype=e4m3, device=meta))
                    if "x_scale" in K.launch_w8_mm.__kwdefaults__:  # an fp8 x: the dot fp8 x fp8
                        for one in (True, False):
                            K.launch_w8_mm(torch.empty(M, Kd, dtype=e4m3, device=meta),
                                           torch.empty(N, Kd, dtype=e4m3, device=meta),
                                           torch.empty(N, 1, device=meta), bias,
                                           x_scale=torch.empty(M, 1, device=meta), out_dtype=dtype, one_launch=one)
                        if bias is None and K.w8_mm_split(M, N, Kd, meta) > 1:
                            K.launch_w8_mm_partials(torch.empty(M, Kd, dtype=e4m3, device=meta),
                                                    torch.empty(N, Kd, dtype=e4m3, device=meta))


def _run_main(name: str, seed: int) -> None:
    argv = sys.argv
    sys.argv = [name, str(seed)]
    try:
        importlib.import_module(name).main()
    finally:
        sys.argv = argv


class _Sm90Driver:
    """Just what ``JITFunction.warmup`` asks of a driver: a device, a stream and the sm_90 target."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def _value(spec):
    import triton.language as tl

    kind = spec[0]
    if kind == "tensor":
        dtype = getattr(torch, spec[1])
        t = torch.empty(64, dtype=dtype)  # 64-byte aligned storage
        return t if spec[2] else t[1:]
    if kind == "tl.dtype":
        return tl.dtype(spec[1])
    if kind == "none":
        return None
    return spec[1]


def _resource_usage(cubin: bytes) -> str:
    """Registers, stack and local memory (spills) of a cubin, from ``cuobjdump`` (Triton's copy)."""
    import os
    import subprocess
    import tempfile

    import triton.backends.nvidia as nvidia

    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    if not tool.exists():
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        Path(path).write_bytes(cubin)
        out = subprocess.run([str(tool), "--dump-resource-usage", path], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    return "regs={} stack={} shared={} local={}".format(*found.groups()) if found else out.strip()[-200:]


def compile_all(launches: list) -> None:
    import triton
    from triton.runtime import driver

    driver.set_active(_Sm90Driver())
    failures, lines = [], []
    for entry in launches:
        module, name = entry["kernel"].split(":")
        fn = getattr(importlib.import_module(module), name)
        assert isinstance(fn, triton.runtime.JITFunction), (entry["kernel"], type(fn))
        args = [_value(s) for s in entry["args"]]
        kwargs = {k: _value(s) for k, s in entry["kwargs"].items()}
        try:
            kernel = fn.warmup(*args, grid=(1,), **kwargs)
            asm = kernel.asm
            assert "cubin" in asm and len(asm["cubin"]) > 0, "no cubin"
            usage = _resource_usage(asm["cubin"])
            line = f"ok {name} {usage} " + " ".join(
                f"{k}={v[1]}" for k, v in entry["kwargs"].items() if v[0] != "tensor")
            dtypes = sorted({s[1] for s in entry["args"] if s[0] == "tensor"})
            line += " (" + ", ".join(dtypes) + ")"
            if line not in lines:
                lines.append(line)
                print(line)
        except Exception as e:  # report every failing launch, then fail
            failures.append((entry, repr(e)[-1500:]))
            print(f"FAIL {name}: {repr(e)[-1500:]}")
    assert not failures, f"{len(failures)} launches did not compile for sm_90"
    print(f"compiled {len(launches)} launches for sm_90")
    print("ok")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "record":
        record(sys.argv[2], int(sys.argv[3]))
    else:
        seen, launches = set(), []
        if len(sys.argv) > 1:
            launches = json.loads(Path(sys.argv[1]).read_text())
            seen = {json.dumps(e, sort_keys=True) for e in launches}
        _record_package_tiles(seen, launches)
        compile_all(launches)
