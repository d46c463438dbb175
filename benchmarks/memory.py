"""Where the memory of an fp8 training step goes: what backward keeps, and peak memory per phase and per run.

For each variant (``bf16``, ``rowwise``, ``rowwise_gw_hp``; ``@eager`` / ``@compile`` overrides ``--compile``) the
script builds the example Llama (``examples/llama.py``), optionally under
FSDP2 over a 1-rank mesh (float32 master weights, ``MixedPrecisionPolicy(bf16, fp32)``, as the e2e benchmark) and
``torch.compile`` per block, runs warm-up steps and then one measured step:

* **saved for backward**: every tensor autograd (eager Functions and compiled graphs alike) saves during the forward,
  seen through ``torch.autograd.graph.saved_tensors_hooks``; subclasses are unwrapped (DTensor → local,
  ScaledFp8Tensor → qdata + scale, master → data). Bytes are counted once per storage and *at the end of the
  forward*, so storages FSDP2 frees after the forward (``reshard_after_forward``) count 0. Split by dtype and by
  whether the storage is a weight (a parameter or FSDP2's unsharded parameter) or an activation.
* **CUDA only**: ``memory_allocated`` at the variant's start (after collecting the previous variant: an FSDP2 model
  is freed only by the cycle collector, so without it every later variant carries the previous one's float32
  parameters), before the step and after the forward; ``max_memory_allocated`` of the warm-up steps (model build,
  compilation, the optimizer's state creation), of the forward, of the backward and of the optimizer step (GiB); and
  ``peak_run_GiB``, the peak of the whole run from the model's construction on.

The optimizer is built as users build it: one ``AdamW`` (fused on CUDA) over ``model.parameters()``, master weights
and plain parameters in one list; ``--optimizer per-kind`` builds one over the parameters whose (local) tensor is an
``Fp8MasterWeight`` and one over the rest, for comparison (the two have the same peak).

Usage: ``PYTHONPATH=. python benchmarks/memory.py --dim 4096 --ffn 14336 --heads 32 --kv-heads 8 --layers 2
--seq 8192 --fsdp --compile [--variants bf16,rowwise@eager,rowwise_gw_hp] [--optimizer one|per-kind] [--history]
[--json out.json]``. On CPU use small sizes.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, ".."))

GiB = 2**30


def _leaves(t):
    """Plain tensors holding ``t``'s bytes (DTensor / LocalTensor / ScaledFp8Tensor / master weight unwrapped)."""
    from fp8tensor import Fp8MasterWeight, ScaledFp8Tensor

    if t is None or not isinstance(t, torch.Tensor):
        return []
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        return _leaves(local)
    shards = getattr(t, "_local_tensors", None)
    if isinstance(shards, dict):
        return [x for s in shards.values() for x in _leaves(s)]
    if isinstance(t, ScaledFp8Tensor):
        return _leaves(t.qdata) + _leaves(t.scale)
    if isinstance(t, Fp8MasterWeight):
        return _leaves(t._data)
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in _leaves(getattr(t, n))]
    return [t]


class SavedTensors:
    """Context manager recording every tensor saved for backward; :meth:`summary` after the forward."""

    def __init__(self, weight_ptrs=()):
        self.saved = []
        self.weight_ptrs = set(weight_ptrs)

    def __enter__(self):
        def pack(t):
            self.saved.append(t)
            return t

        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    def summary(self, extra_weight_ptrs=()) -> dict:
        """Bytes per (kind, dtype) over distinct storages, as allocated now."""
        weights = self.weight_ptrs | set(extra_weight_ptrs)
        seen = {}
        for t in self.saved:
            for leaf in _leaves(t):
                st = leaf.untyped_storage()
                seen.setdefault(st.data_ptr(), (st.nbytes(), leaf.dtype))
        out = defaultdict(int)
        for ptr, (nbytes, dtype) in seen.items():
            if ptr == 0 or nbytes == 0:
                continue
            kind = "weight" if ptr in weights else "activation"
            out[f"{kind}:{str(dtype).replace('torch.', '')}"] += nbytes
        return dict(sorted(out.items()))


def _param_ptrs(model):
    ptrs = set()
    for p in model.parameters():
        for leaf in _leaves(p):
            ptrs.add(leaf.untyped_storage().data_ptr())
    # FSDP2's unsharded parameters (the all-gather outputs the forward sees)
    for m in model.modules():
        state = getattr(m, "_get_fsdp_state", None)
        if state is None:
            continue
        try:
            group = state()._fsdp_param_group
        except Exception:
            continue
        if group is None:
            continue
        for fp in group.fsdp_params:
            for name in ("_unsharded_param", "_unsharded_inner_tensors", "all_gather_outputs"):
                obj = getattr(fp, name, None)
                for t in (obj if isinstance(obj, (list, tuple)) else [obj]):
                    for leaf in _leaves(t):
                        try:
                            ptrs.add(leaf.untyped_storage().data_ptr())
                        except Exception:
                            pass
    return ptrs


def build(args, variant: str, device):
    from llama import Llama, ModelArgs, fp8_module_filter

    margs = ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                      max_seq_len=args.seq, vocab_size=256, ffn_hidden=args.ffn or None)
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(margs)
    recipe = variant
    if recipe != "bf16":
        import fp8tensor

        fp8tensor.convert_to_fp8(model, recipe=recipe, module_filter_fn=fp8_module_filter)
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (1,))
        if args.compile:
            for block in model.layers:
                block.compile()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:  # as benchmarks/e2e.py
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=args.reshard)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    else:
        model.to(torch.bfloat16)
        if args.compile:
            for block in model.layers:
                block.compile()
    if args.ckpt:
        from torch.utils.checkpoint import checkpoint

        for block in model.layers:
            fwd = block.forward
            block.forward = lambda *a, _f=fwd: checkpoint(_f, *a, use_reentrant=False)
    return model


def make_optimizer(model, how: str, fused: bool):
    """AdamW (lr 1e-4) over ``model.parameters()``: ``how="one"`` one optimizer over all of them (what users and
    torchtitan build); ``"per-kind"`` one over the parameters whose tensor (a DTensor's local tensor) is an
    ``Fp8MasterWeight`` and one over the rest, stepped and zeroed together. Raises ``ValueError`` for another
    ``how``."""
    from fp8tensor import Fp8MasterWeight

    params = list(model.parameters())
    if how == "one":
        return torch.optim.AdamW(params, lr=1e-4, fused=fused)
    if how != "per-kind":
        raise ValueError(f"memory.py: --optimizer must be 'one' or 'per-kind', got {how!r}")
    is_master = [isinstance(getattr(p, "_local_tensor", p), Fp8MasterWeight) for p in params]
    groups = [[p for p, m in zip(params, is_master) if m], [p for p, m in zip(params, is_master) if not m]]
    opts = [torch.optim.AdamW(g, lr=1e-4, fused=fused) for g in groups if g]
    from _util import Optimizers

    return opts[0] if len(opts) == 1 else Optimizers(opts)


def run_variant(args, variant: str, device) -> dict:
    variant, _, how = variant.partition("@")
    args = argparse.Namespace(**vars(args))
    if how == "eager":
        args.compile = False
    elif how == "compile":
        args.compile = True
    torch._dynamo.reset()
    gc.collect()  # a previous variant's FSDP2 model is only freed by the collector (reference cycles)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    model = build(args, variant, device)
    opt = make_optimizer(model, args.optimizer, fused=cuda)
    tokens = torch.randint(0, 256, (args.batch, args.seq), device=device)
    target = torch.randint(0, 256, (args.batch, args.seq), device=device)

    def loss_fn(logits):
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    t0 = time.time()
    for _ in range(args.warmup):
        loss_fn(model(tokens)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    res = {"variant": variant + ("@compile" if args.compile else "@eager"), "warmup_s": round(time.time() - t0, 1),
           "optimizer": args.optimizer}
    if cuda:
        torch.cuda.synchronize()
        res["start_GiB"] = start / GiB
        res["peak_warmup_GiB"] = torch.cuda.max_memory_allocated() / GiB
        torch.cuda.reset_peak_memory_stats()
        res["before_step_GiB"] = torch.cuda.memory_allocated() / GiB
    if cuda and args.history:
        torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    rec = SavedTensors(_param_ptrs(model))
    with rec:
        loss = loss_fn(model(tokens))
    if cuda:
        torch.cuda.synchronize()
        res["after_fwd_GiB"] = torch.cuda.memory_allocated() / GiB
        res["peak_fwd_GiB"] = torch.cuda.max_memory_allocated() / GiB
        torch.cuda.reset_peak_memory_stats()
    res["saved_MiB"] = {k: round(v / 2**20, 2) for k, v in rec.summary(_param_ptrs(model)).items()}
    rec.saved.clear()
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
        res["peak_bwd_GiB"] = torch.cuda.max_memory_allocated() / GiB
        torch.cuda.reset_peak_memory_stats()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        res["peak_opt_GiB"] = torch.cuda.max_memory_allocated() / GiB
        res["peak_step_GiB"] = max(res["peak_fwd_GiB"], res["peak_bwd_GiB"], res["peak_opt_GiB"])
        res["peak_run_GiB"] = max(res["peak_warmup_GiB"], res["peak_step_GiB"])
        if args.history:
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            res["live_at_peak"] = live_at_peak(snap, args.top)
        for k in list(res):
            if k.endswith("GiB"):
                res[k] = round(res[k], 3)
    res["loss"] = float(loss)
    del model, opt, loss
    if cuda:
        torch.cuda.empty_cache()
    return res


def _where(frames) -> str:
    """The innermost frame of interest of an allocation: generated inductor code (with its source line), fp8tensor,
    FSDP2 or autograd."""
    import linecache

    keys = ("torchinductor", "fp8tensor/", "_fully_shard", "examples/llama", "torch/optim", "autograd")
    for f in frames:
        fn = f.get("filename", "")
        if any(k in fn for k in keys):
            src = linecache.getline(fn, f.get("line", 0)).strip()
            short = fn.split("/")[-1] if "torchinductor" in fn else "/".join(fn.split("/")[-2:])
            return f"{short}:{f.get('line')} {f.get('name')}: {src[:140]}"
    return "|".join(f"{f.get('name')}" for f in frames[:3])


def live_at_peak(snap, top: int = 25) -> dict:
    """From a memory snapshot recorded over one step: the peak of the bytes allocated *during the recording*, and the
    allocations live at that moment grouped by where they were made."""
    events = [e for dev in snap["device_traces"] for e in dev]
    live, cur, peak, at_peak = {}, 0, 0, {}
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = i
            cur += e["size"]
        elif e["action"] in ("free_requested",) and e["addr"] in live:
            del live[e["addr"]]
            cur -= e["size"]
        if cur > peak:
            peak, at_peak = cur, dict(live)
    groups = defaultdict(lambda: [0, 0])
    for addr, i in at_peak.items():
        e = events[i]
        g = groups[_where(e.get("frames", []))]
        g[0] += e["size"]
        g[1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return {"peak_above_start_GiB": round(peak / GiB, 3),
            "top": [f"{b / 2**20:9.1f} MiB x{n:3d}  {w}" for w, (b, n) in rows]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--ffn", type=int, default=0, help="FFN hidden size (0: the model's default)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--fsdp", action="store_true", help="FSDP2 over one rank, float32 master, bf16 compute")
    p.add_argument("--reshard", action="store_true", help="reshard_after_forward=True (default False, dp=1)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--ckpt", action="store_true", help="activation checkpointing per block")
    p.add_argument("--variants", default="bf16,rowwise,rowwise_gw_hp")
    p.add_argument("--optimizer", choices=("one", "per-kind"), default="one",
                   help="one AdamW over model.parameters() (default), or one per kind of parameter (master / other)")
    p.add_argument("--json", default=None)
    p.add_argument("--history", action="store_true", help="CUDA: record allocations, report what is live at the peak")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.fsdp:
        import torch.distributed as dist

        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    results = []
    for v in args.variants.split(","):
        try:
            r = run_variant(args, v, device)
        except Exception as e:  # noqa: BLE001 - report and go on with the next variant
            import traceback

            traceback.print_exc()
            r = {"variant": v, "error": f"{type(e).__name__}: {e}"[:500]}
        r["config"] = {k: getattr(args, k) for k in ("dim", "ffn", "heads", "kv_heads", "layers", "seq", "batch",
                                                     "fsdp", "reshard", "compile", "ckpt", "optimizer")}
        print(json.dumps(r), flush=True)
        results.append(r)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
