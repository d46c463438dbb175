"""Train a small byte-level Llama with FSDP2 x tensor parallelism, in bf16 and in fp8.

Run with ``torchrun``; the world is arranged as a 2-D mesh ``dp x tp``
(``--tp`` ranks per tensor-parallel group, ``dp = world_size / tp``)::

    torchrun --nproc-per-node 4 examples/train.py            # dp=2 x tp=2, CPU/gloo
    torchrun --nproc-per-node 8 examples/train.py --tp 4 --device cuda

With ``--mode both`` (default) the same model (same seed -> same initial
weights) is trained twice on the same batches: once with plain bf16 matmuls
and once with the transformer blocks' Linears converted by
``fp8tensor.convert_to_fp8`` (the embedding and output head stay in high
precision). Rank 0 shows a progress bar, then evaluates both on the held-out
split and writes ``losses.json`` and ``loss_curve.png`` to ``--out``. The last
line printed is::

    final val loss: bf16 X.XXXX  fp8 Y.YYYY  gap Z.ZZ%

where the gap is ``(fp8 - bf16) / bf16`` in percent. One run cannot tell whether a gap is larger than
bf16's own seed-to-seed noise: ``examples/seed_spread.py`` runs several seeds and says (for the default
run, the gaps of seeds 0-2 lie inside bf16's range; see the README).

Data: bytes of the Python standard library sources (no download), or any
text file / directory given by ``--data``; see ``examples/data.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Sibling modules (data, llama); and the checkout's fp8tensor when it is not installed
# (appended, so an installed fp8tensor takes precedence).
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))

from data import DEFAULT_MAX_BYTES, RandomWindows, fixed_windows, load_corpus, split_corpus  # noqa: E402
from llama import Llama, ModelArgs, fp8_module_filter, parallelize_llama  # noqa: E402

RECIPES = ("rowwise", "rowwise_gw_hp")
GRAPH_WARMUP = 3  # eager steps before the capture with --cuda-graph (compile, allocator and communicator warm-up)
VAL_SEED = 1  # the held-out windows do not depend on --seed, so runs with different seeds compare

# FSDP2 warns that the root module returns a view (the logits come out of
# DTensor.to_local()); the training loop never modifies them in place.
warnings.filterwarnings("ignore", message=r".*returned a view tensor.*")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends ``(default: X)`` to every option that takes a value, unless its help already says the default.

    On/off flags (``store_true`` / ``store_false``) show no default: they are off unless given.
    """

    def _get_help_string(self, action):
        text = action.help or ""
        if (isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
                or "default" in text or action.default in (None, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


_USAGE_NOTE = """\
Launch with torchrun, one process per rank; the ranks form a dp x tp mesh (dp = ranks / --tp):

  torchrun --nproc-per-node 4 examples/train.py                        # CPU (gloo): dp=2 x tp=2
  torchrun --nproc-per-node 8 examples/train.py --tp 4 --device cuda   # 8 GPUs (NCCL): dp=2 x tp=4
  python examples/train.py --tp 1                                      # one process, no tensor parallelism

The last line printed is `final val loss: bf16 X  fp8 Y  gap Z%` (gap = (fp8 - bf16) / bf16).
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see ``--help``); defaults target a 2-core CPU, 4 ranks."""
    p = argparse.ArgumentParser(prog="examples/train.py", description=__doc__.split("\n\n")[0],
                                epilog=_USAGE_NOTE, formatter_class=_HelpFormatter)
    p.add_argument("--mode", choices=("both", "bf16", "fp8"), default="both",
                   help="which precision(s) to train")
    p.add_argument("--recipe", choices=RECIPES, default="rowwise",
                   help="fp8tensor recipe for the fp8 run")
    p.add_argument("--size-rule", action="store_true",
                   help="fp8tensor's size-aware choice (convert_to_fp8(size_rule=True)): Linears too small for fp8 "
                        "stay bf16, mid-sized rowwise ones compute grad_weight in bf16")
    p.add_argument("--tp", type=int, default=2,
                   help="tensor-parallel degree; must divide the number of ranks")
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                   help="replicate the residual stream over the TP ranks (without this flag it is sharded "
                        "along the sequence: sequence parallelism is on by default)")
    p.add_argument("--sp-fp8-comm", action="store_true",
                   help="fp8 run: all-gather sequence-parallel activations in fp8 "
                        "(fp8tensor.Fp8PrepareModuleInput)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda if available, else cpu")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each block (faster steps; ~1 min of compile per run on CPU)")
    p.add_argument("--compile-mode", default=None,
                   choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
                   help="torch.compile mode of the blocks (implies --compile). reduce-overhead: CUDA graphs per "
                        "block, for small per-GPU models whose steps wait on the host; under FSDP2 their graphs "
                        "settle after ~20 steps, so also pass --timing-skip 25 (docs/fsdp.md, 'CUDA graphs')")
    p.add_argument("--cuda-graph", action="store_true",
                   help="capture each step's forward + loss + backward as one CUDA graph and replay it "
                        "(fp8tensor.graph_step; the optimizer step and gradient clipping stay outside): removes the "
                        "host waits of small per-GPU models. Needs --device cuda; combine with --compile")
    p.add_argument("--timing-skip", type=int, default=None,
                   help="first steps left out of the reported tok/s (compile and warm-up; default 1, with "
                        "--cuda-graph 4: three warm-up steps and the capture)")
    p.add_argument("--steps", type=int, default=120, help="training steps per run")
    p.add_argument("--log-every", type=int, default=50,
                   help="when stdout is not a terminal: print one progress line every N steps (and at the last)")
    p.add_argument("--seq-len", type=int, default=128,
                   help="tokens (bytes) per sequence; with sequence parallelism a multiple of --tp")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step and data-parallel rank")
    p.add_argument("--dim", type=int, default=256, help="model width")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--heads", type=int, default=8, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads (grouped-query attention)")
    p.add_argument("--moe", action="store_true",
                   help="mixture-of-experts MLPs (router, top-k experts as grouped GEMMs; fp8: the experts' grouped "
                        "GEMMs run in fp8, docs/moe.md); needs --tp 1. With --compile the experts run eagerly "
                        "inside the compiled blocks")
    p.add_argument("--experts", type=int, default=None, help="experts per MoE layer (with --moe; default 8)")
    p.add_argument("--top-k", type=int, default=None, help="experts per token (with --moe; default 2)")
    p.add_argument("--shared-expert", action="store_true", default=None,
                   help="add a shared expert to every MoE layer (with --moe)")
    p.add_argument("--aux-loss-coeff", type=float, default=None,
                   help="weight of the load-balancing loss (with --moe; default 0.01)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay of the matrices")
    p.add_argument("--warmup", type=int, default=None,
                   help="linear warm-up steps, then cosine decay to 10%% of --lr (default: steps/10, at least 1)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clipping; 0 disables it")
    p.add_argument("--val-batches", type=int, default=8, help="validation batches per data-parallel rank")
    p.add_argument("--data", default=None,
                   help="text file or directory (default: the Python standard library's sources)")
    p.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                   help="read at most this many bytes of the corpus")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the initial weights and of the training batches (the validation batches "
                        "are the same for every seed)")
    p.add_argument("--out", default="out/example", help="output directory (losses.json, loss_curve.png)")
    args = p.parse_args(argv)
    if args.compile_mode is not None:
        args.compile = True
    args.moe_options_given = [f for f, v in (("--experts", args.experts), ("--top-k", args.top_k),
                                             ("--shared-expert", args.shared_expert),
                                             ("--aux-loss-coeff", args.aux_loss_coeff)) if v is not None]
    for name, default in (("experts", 8), ("top_k", 2), ("shared_expert", False), ("aux_loss_coeff", 0.01)):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.timing_skip is None:
        args.timing_skip = GRAPH_WARMUP + 1 if args.cuda_graph else 1
    return args


def _timing_note(skip: int) -> str:
    """What the reported tok/s leaves out."""
    if skip == 1:
        return "after the first step, which includes compile / warm-up"
    return f"after the first {skip} steps, which include compile / warm-up"


def _launch_env() -> tuple[int, int, int]:
    """``(rank, world_size, local_world_size)`` as set by torchrun; ``(0, 1, 1)`` for a plain ``python`` run."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    return int(os.environ.get("RANK", 0)), world, int(os.environ.get("LOCAL_WORLD_SIZE", world))


def check_args(args: argparse.Namespace, world: int, local_world: int) -> str | None:
    """Return what is wrong with the arguments for a run on ``world`` ranks, or ``None``.

    Everything that would otherwise fail later inside a collective (and then hang or abort every rank) is
    checked here, before the process group exists.
    """
    launched = "WORLD_SIZE" in os.environ
    if args.cuda_graph and (args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())):
        return "--cuda-graph needs CUDA (--device cuda): CUDA graphs do not exist on the CPU"
    if getattr(args, "moe_options_given", None) and not args.moe:
        return f"{', '.join(args.moe_options_given)} only apply to the MoE model: add --moe"
    for flag, value, low in (("--tp", args.tp, 1), ("--steps", args.steps, 1), ("--seq-len", args.seq_len, 1),
                             ("--batch-size", args.batch_size, 1), ("--dim", args.dim, 1),
                             ("--layers", args.layers, 1), ("--heads", args.heads, 1),
                             ("--kv-heads", args.kv_heads, 1), ("--val-batches", args.val_batches, 1),
                             ("--timing-skip", args.timing_skip, 1),
                             ("--warmup", 0 if args.warmup is None else args.warmup, 0)):
        if value < low:
            return f"{flag} must be at least {low}, got {value}"
    if args.timing_skip >= args.steps:
        return f"--timing-skip {args.timing_skip} leaves no timed step of --steps {args.steps}"
    if not args.lr > 0 or not math.isfinite(args.lr):
        return f"--lr must be a positive number, got {args.lr}"
    if not args.grad_clip >= 0:
        return f"--grad-clip must be >= 0 (0 disables clipping), got {args.grad_clip}"
    if args.moe and args.tp != 1:
        return (f"--moe runs with --tp 1 (data parallel FSDP2; the experts have no tensor-parallel plan), "
                f"got --tp {args.tp}")
    if args.moe and not 1 <= args.top_k <= args.experts:
        return f"--top-k must be between 1 and --experts {args.experts}, got {args.top_k}"
    if world % args.tp:
        hint = (f"launch with torchrun, e.g. `torchrun --nproc-per-node {max(args.tp, 2 * args.tp)} "
                f"examples/train.py --tp {args.tp}`, or run one process with --tp 1")
        where = " (not launched by torchrun)" if world == 1 and not launched else ""
        return f"world size {world}{where} is not divisible by --tp {args.tp}: {hint}"
    if args.sp_fp8_comm and not args.sequence_parallel:
        return "--sp-fp8-comm needs sequence parallelism (drop --no-sequence-parallel)"
    if args.dim % args.heads:
        return f"--dim {args.dim} is not divisible by --heads {args.heads}"
    if args.heads % args.kv_heads:
        return f"--heads {args.heads} is not divisible by --kv-heads {args.kv_heads}"
    if (args.dim // args.heads) % 2:
        return f"head dim --dim / --heads = {args.dim // args.heads} must be even (rotary embedding)"
    if args.tp > 1:
        margs = ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads)
        for flag, n in (("--heads", args.heads), ("--kv-heads", args.kv_heads),
                        ("the FFN hidden dim (from --dim)", margs.hidden_dim)):
            if n % args.tp:
                return f"{flag} = {n} is not divisible by --tp {args.tp}"
        if args.sequence_parallel and args.seq_len % args.tp:
            return (f"--seq-len {args.seq_len} is not divisible by --tp {args.tp}: sequence parallelism shards "
                    f"the sequence over the TP ranks (pick a multiple of {args.tp} or pass --no-sequence-parallel)")
    if args.cuda_graph and args.compile_mode == "reduce-overhead":
        return "--cuda-graph already captures the whole step: compile the blocks in the default mode (--compile)"
    if args.data is not None and not Path(args.data).exists():
        return f"--data path does not exist: {args.data}"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            return "--device cuda, but CUDA is not available (use --device cpu)"
        if local_world > torch.cuda.device_count():
            return (f"{local_world} ranks on this node but only {torch.cuda.device_count()} CUDA device(s): "
                    f"pass --nproc-per-node {torch.cuda.device_count()} or fewer to torchrun")
    return None


def fail(message: str, rank: int) -> None:
    """Stop before any collective: rank 0 prints ``message`` as one line on stderr and exits with status 2.

    The other ranks exit quietly with status 0: a launcher such as torchrun stops the remaining ranks as soon as
    one fails, and must not stop rank 0 before it has printed. The launcher's own exit status is non-zero.
    """
    if rank == 0:
        print(f"examples/train.py: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    raise SystemExit(0)


def log(*a) -> None:
    """Print on rank 0 only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*a, flush=True)


def fp8_converter():
    """Return ``fp8tensor.convert_to_fp8`` or ``None`` if the package is not usable."""
    try:
        import fp8tensor

        return fp8tensor.convert_to_fp8
    except (ImportError, AttributeError):
        return None


def setup(args) -> tuple[torch.device, object]:
    """Initialise the process group and a ``("dp", "tp")`` device mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    dev_type = args.device
    if dev_type == "auto":
        dev_type = "cuda" if torch.cuda.is_available() else "cpu"
    if dev_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if dev_type == "cuda" else "gloo"
        if "WORLD_SIZE" in os.environ:  # launched by torchrun
            dist.init_process_group(backend=backend)
        else:  # plain `python train.py --tp 1`: a single-process group
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    mesh = init_device_mesh(dev_type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    return device, mesh


def lr_at(step: int, args) -> float:
    """Linear warm-up then cosine decay to 10% of the peak learning rate."""
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    t = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def grad_norm_clip_(params, max_norm: float) -> float:
    """Clip gradients to a total L2 norm of ``max_norm``; return the norm before clipping.

    Works when parameters are DTensors on different meshes (e.g. TP-only and
    FSDP x TP) or plain tensors, which ``torch.nn.utils.clip_grad_norm_`` does
    not accept, and needs a single all-reduce: every rank sums the squares of
    its local shards, divided by how many ranks hold a copy of that shard.
    """
    from torch.distributed.tensor import DTensor, Replicate

    world = dist.get_world_size()
    params = [p for p in params if p.grad is not None]
    for p in params:  # e.g. SequenceParallel norm weights without FSDP
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(
                g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements]
            )
    grads = [p.grad for p in params]
    sq = None
    for g in grads:
        if isinstance(g, DTensor):
            copies = world // g.device_mesh.size()  # ranks outside the grad's mesh
            for dim, pl in enumerate(g.placements):
                if isinstance(pl, Replicate):
                    copies *= g.device_mesh.size(dim)
            local = g.to_local()
        else:
            copies, local = world, g
        s = local.detach().float().pow(2).sum() / copies
        sq = s if sq is None else sq + s
    if sq is None:
        return 0.0
    dist.all_reduce(sq)
    total = sq.sqrt().item()
    if max_norm > 0 and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for g in grads:
            g.mul_(scale)
    return total


def build_model(args, mesh, device, fp8: bool) -> torch.nn.Module:
    """Create (seeded init), optionally fp8-convert, then parallelize the model."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    margs = ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, max_seq_len=max(args.seq_len, 16),
                      moe=args.moe, n_experts=args.experts, top_k=args.top_k, shared_expert=args.shared_expert,
                      aux_loss_coeff=args.aux_loss_coeff)
    torch.manual_seed(args.seed)  # same initial weights for the bf16 and fp8 runs
    model = Llama(margs).to(device)
    # float32 master weights, bf16 compute and all-gathers, float32 gradient reduction: FSDP2's mixed precision,
    # also when the dp dim has size 1 (then FSDP2 shards nothing and only manages the bf16 copies).
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if fp8:
        convert = fp8_converter()
        convert(model, recipe=args.recipe, module_filter_fn=fp8_module_filter,
                **({"size_rule": True} if args.size_rule else {}))
    # With one dp rank resharding after forward frees nothing worth the re-gather (for fp8: the re-quantization of
    # every weight) before backward; with more ranks it frees the gathered weights between forward and backward.
    parallelize_llama(model, mesh["tp"], mesh["dp"], sequence_parallel=args.sequence_parallel,
                      mp_policy=mp_policy,
                      compile=(args.compile_mode or True) if args.compile else False, reshard_after_forward=mesh["dp"].size() > 1,
                      sp_fp8_comm=fp8 and args.sp_fp8_comm and mesh["tp"].size() > 1)
    return model


@torch.no_grad()
def evaluate(model, batches, device, mesh) -> float:
    """Mean cross-entropy over ``batches`` (averaged over data-parallel ranks)."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    for x, y in batches:
        logits = model(x.to(device))
        total += F.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten()).cpu()
    model.train()
    return _dp_mean(total / len(batches), mesh)


def _dp_mean(value: torch.Tensor, mesh) -> float:
    """Average a scalar over the data-parallel ranks."""
    return _dp_mean_list([float(value)], mesh)[0]


def _dp_mean_list(values: list[float], mesh) -> list[float]:
    """Average a list of floats element-wise over the data-parallel ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=mesh.device_type)
    if mesh["dp"].size() > 1:
        dist.all_reduce(t, group=mesh["dp"].get_group())
        t /= mesh["dp"].size()
    return t.tolist()


def train_one(name: str, args, train_data, val_data, device, mesh) -> dict:
    """Train one model (``name`` in ``{"bf16", "fp8"}``) and return its metrics."""
    from tqdm import tqdm

    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    t_build = time.perf_counter()
    model = build_model(args, mesh, device, fp8=(name == "fp8"))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )
    batches = RandomWindows(train_data, args.batch_size, args.seq_len, seed=args.seed,
                            shard=dp_rank, num_shards=dp_size)
    tokens_per_step = args.batch_size * args.seq_len * dp_size
    local_losses: list[float] = []
    # A progress bar on a terminal; elsewhere (a log file, CI) one line every --log-every steps and at the last
    log_lines = dist.get_rank() == 0 and not sys.stdout.isatty()
    bar = tqdm(range(args.steps), desc=name, disable=dist.get_rank() != 0 or log_lines,
               dynamic_ncols=True, mininterval=1.0, file=sys.stdout)
    t_start = t_timed = time.perf_counter()
    timed_steps = 0
    def fwd_bwd(x, y):
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        if args.moe:  # the load-balancing loss is trained, the reported loss stays the language-model loss
            (loss + model.aux_loss().to(loss.device)).backward()
        else:
            loss.backward()
        return loss.detach()

    if args.cuda_graph:  # forward + loss + backward as one CUDA graph; the optimizer stays outside
        import fp8tensor

        fwd_bwd = fp8tensor.graph_step(fwd_bwd, model, warmup_steps=GRAPH_WARMUP, enabled=True)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = next(batches)
        loss = fwd_bwd(x.to(device), y.to(device))
        gnorm = grad_norm_clip_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=not args.cuda_graph)  # a captured backward accumulates into the same tensors
        # gnorm is global (all-reduced), so every rank stops at the same step.
        if not math.isfinite(gnorm):
            raise RuntimeError(f"{name}: non-finite gradient norm at step {step}")
        loss_val = loss.item()  # this rank's loss; averaged over dp ranks after training
        local_losses.append(loss_val)
        if step == args.timing_skip - 1:  # the first --timing-skip steps (compile / warm-up) are not timed
            t_timed, timed_steps = time.perf_counter(), 0
        elif step >= args.timing_skip:
            timed_steps += 1
        elapsed = time.perf_counter() - t_timed
        tok_s = tokens_per_step * timed_steps / elapsed if timed_steps else 0.0
        bar.set_postfix(loss=f"{loss_val:.4f}", gnorm=f"{gnorm:.2f}", tok_s=f"{tok_s:,.0f}")
        if log_lines and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
            print(f"{name} step {step + 1}/{args.steps}  loss {loss_val:.4f}  gnorm {gnorm:.2f}  tokens/s {tok_s:,.0f}",
                  flush=True)
    bar.close()
    train_s = time.perf_counter() - t_start
    losses = _dp_mean_list(local_losses, mesh)  # one collective instead of one per step
    val_loss = evaluate(
        model,
        fixed_windows(val_data, args.val_batches, args.batch_size, args.seq_len,
                      seed=VAL_SEED, shard=dp_rank, num_shards=dp_size),
        device, mesh,
    )
    result = {
        "train_loss": losses,
        "val_loss": val_loss,
        "tokens_per_s": tok_s,
        "train_seconds": train_s,
        "total_seconds": time.perf_counter() - t_build,
    }
    log(f"{name}: val loss {val_loss:.4f}  train loss {losses[-1]:.4f}  "
        f"{tok_s:,.0f} tok/s ({_timing_note(args.timing_skip)})  {train_s:.1f}s")
    if args.cuda_graph:
        fwd_bwd.close()
    del model, opt, fwd_bwd
    if args.compile:
        torch._dynamo.reset()  # the next run compiles its own blocks from a clean cache
    return result


def save_outputs(out_dir: Path, args, results: dict, gap_pct: float | None) -> None:
    """Write ``losses.json`` and ``loss_curve.png`` (drawn by ``examples/plot_losses.py``) into ``out_dir``.

    The plot shows each run's per-step training loss (averaged over data-parallel ranks), its moving average and
    final validation loss and, when both runs exist, a lower panel with the relative difference fp8 vs bf16 of
    the smoothed training losses.
    """
    from plot_losses import plot

    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "argv": sys.argv[1:],
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "config": dict(vars(args)),
        "world_size": dist.get_world_size(),
        "runs": results,
        "val_gap_pct": gap_pct,
    }
    (out_dir / "losses.json").write_text(json.dumps(payload, indent=1))
    plot(payload, out_dir / "loss_curve.png")


def main(argv: list[str] | None = None) -> dict:
    """Entry point; returns the per-run results (on every rank)."""
    args = parse_args(argv)
    rank, world, local_world = _launch_env()
    problem = check_args(args, world, local_world)
    if problem is None and args.mode == "fp8" and fp8_converter() is None:
        problem = "--mode fp8, but fp8tensor.convert_to_fp8 is not available"
    if problem is None:  # the corpus is read (identically) on every rank, before the process group exists
        try:
            corpus = load_corpus(args.data, max_bytes=args.max_bytes)
            train_data, val_data = split_corpus(corpus)
            for split, part in (("training", train_data), ("validation", val_data)):
                if len(part) < args.seq_len + 1:
                    raise ValueError(f"the {split} split has {len(part):,} bytes, fewer than --seq-len + 1 = "
                                     f"{args.seq_len + 1} (raise --max-bytes or lower --seq-len)")
        except (OSError, ValueError) as e:
            problem = f"corpus: {e}"
    if problem is not None:  # before any collective: every rank exits, rank 0 says why
        fail(problem, rank)
    device, mesh = setup(args)
    modes = ["bf16", "fp8"] if args.mode == "both" else [args.mode]
    if "fp8" in modes and fp8_converter() is None:
        log("warning: fp8tensor.convert_to_fp8 is not available; running bf16 only")
        modes = ["bf16"]

    dp, tp = mesh["dp"].size(), mesh["tp"].size()
    # The default corpus is this Python's standard library: its fingerprint tells whether two runs saw the same bytes.
    digest = hashlib.sha256(corpus.numpy().tobytes()).hexdigest()[:12]
    log(f"Python {platform.python_version()}, torch {torch.__version__}")
    log(f"world {dist.get_world_size()} = dp {dp} x tp {tp} on {device.type} | corpus "
        f"{len(corpus):,} bytes, sha256 {digest} ({len(train_data):,} train / {len(val_data):,} val) | "
        f"dim {args.dim} layers {args.layers} heads {args.heads}/{args.kv_heads} "
        f"seq {args.seq_len} batch {args.batch_size}x{dp} steps {args.steps}")

    results = {name: train_one(name, args, train_data, val_data, device, mesh) for name in modes}

    gap = None
    if "bf16" in results and "fp8" in results:
        b, f = results["bf16"]["val_loss"], results["fp8"]["val_loss"]
        gap = 100.0 * (f - b) / b
    if dist.get_rank() == 0:
        save_outputs(Path(args.out), args, results, gap)
        parts = [f"{n} {r['val_loss']:.4f}" for n, r in results.items()]
        line = "final val loss: " + "  ".join(parts)
        if gap is not None:
            line += f"  gap {gap:.2f}%"
        print(line, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
