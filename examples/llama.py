"""A compact Llama-style decoder and its 2-D (FSDP2 x tensor-parallel) layout.

The model is the usual pre-norm decoder: RMSNorm, rotary position embeddings,
grouped-query attention through ``F.scaled_dot_product_attention`` and a
SwiGLU MLP. Module names follow the common Llama convention so that
parallelization plans and fp8 module filters can refer to them::

    tok_embeddings
    layers[i].attention_norm
    layers[i].attention.{wq, wk, wv, wo}
    layers[i].ffn_norm
    layers[i].feed_forward.{w1, w2, w3}
    norm
    output

:func:`parallelize_llama` applies PyTorch's own tensor-parallel styles
(``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
``PrepareModuleInput``) over a TP mesh and then ``fully_shard`` over a
data-parallel mesh. Attention infers its *local* head count from the local
shard of the q/k/v projections (last dim // head_dim), so the same
module code runs unsharded or tensor-parallel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

__all__ = [
    "ModelArgs",
    "RMSNorm",
    "Attention",
    "FeedForward",
    "TransformerBlock",
    "Llama",
    "parallelize_llama",
    "block_tp_plan",
    "fp8_module_filter",
]


@dataclass
class ModelArgs:
    """Hyper-parameters of :class:`Llama`.

    ``dim`` must be divisible by ``n_heads``; ``n_heads`` by ``n_kv_heads``.
    For tensor parallelism of degree ``tp``, ``n_heads``, ``n_kv_heads``, the
    FFN hidden size and ``vocab_size`` must all be divisible by ``tp``.
    """

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 256
    ffn_hidden: int | None = None  # default: 8/3 * dim rounded up to `multiple_of`
    multiple_of: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        h = int(8 * self.dim / 3)
        return self.multiple_of * math.ceil(h / self.multiple_of)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm: ``x / rms(x) * weight`` over the last dim.

    The statistics are computed in float32 (float64 for float64 inputs) and the
    result is cast back to the input dtype. Input and output: ``[..., dim]``.
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype != torch.float64 else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_table(head_dim: int, seq_len: int, theta: float = 10000.0) -> torch.Tensor:
    """Rotary-embedding table.

    Returns:
        float32 tensor ``[2, seq_len, head_dim // 2]``: ``cos`` then ``sin`` of
        ``position * theta ** (-2i / head_dim)``.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return torch.stack([angles.cos(), angles.sin()]).float()


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, T, H, D]`` by the table ``rope`` ``[2, >=T, D/2]``.

    Uses the "rotate half" convention (first and second halves of the head
    dimension form the pairs). Computed in float32, returned in ``x.dtype``.
    """
    T = x.shape[1]
    cos = rope[0, :T, None, :]  # [T, 1, D/2]
    sin = rope[1, :T, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings.

    Input ``x``: ``[B, T, dim]``; ``rope``: ``[2, >=T, head_dim/2]`` (``None``: no
    rotary embedding).
    Output: ``[B, T, dim]``. Head counts are inferred from the projection
    outputs, so under tensor parallelism (column-sharded ``wq/wk/wv``) each
    rank attends over its local heads only.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.dim % args.n_heads or args.n_heads % args.n_kv_heads:
            raise ValueError("dim % n_heads and n_heads % n_kv_heads must be 0")
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.head_dim

        def heads(t):  # [B, T, local heads, hd]: all heads unsharded, heads/tp under TP (also for 0 tokens)
            return t.view(B, T, t.shape[-1] // hd, hd)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]
        )
        out = out.transpose(1, 2)
        return self.wo(out.reshape(B, T, out.shape[2] * out.shape[3]))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1(x)) * w3(x))``. ``[B, T, dim] -> [B, T, dim]``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention then SwiGLU MLP."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Decoder-only language model.

    ``forward(tokens)``: ``tokens`` int64 ``[B, T]`` (``T <= max_seq_len``)
    -> logits ``[B, T, vocab_size]`` in the dtype of the output layer.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer(
            "rope", rope_table(args.head_dim, args.max_seq_len, args.rope_theta),
            persistent=False,
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Deterministic (given the global RNG) GPT-style initialization.

        Embedding ~ N(0, 1); linears ~ N(0, 0.02), with the residual-branch
        outputs (``wo``, ``w2``) scaled by ``1/sqrt(2 * n_layers)``; output
        layer ~ N(0, dim^-0.5); norm weights = 1.
        """
        nn.init.normal_(self.tok_embeddings.weight, std=1.0)
        depth_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for layer in self.layers:
            for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv,
                        layer.feed_forward.w1, layer.feed_forward.w3):
                nn.init.normal_(lin.weight, std=0.02)
            for lin in (layer.attention.wo, layer.feed_forward.w2):
                nn.init.normal_(lin.weight, std=depth_std)
            layer.attention_norm.reset_parameters()
            layer.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        nn.init.normal_(self.output.weight, std=self.args.dim ** -0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        if isinstance(h, AsyncCollectiveTensor):
            # Under TP the embedding's output is the pending result of its reduce-scatter / all-reduce. Handing
            # that wrapper to a torch.compile-d block breaks the backward on torch 2.13 (the gradient reaches
            # DTensor's redistribute as a plain tensor: "'Tensor' object has no attribute '_local_tensor'");
            # an eager out-of-place op waits for the collective and returns a plain tensor that autograd tracks.
            h = h.clone()
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.output(self.norm(h))


def fp8_module_filter(module: nn.Module, fqn: str) -> bool:
    """``module_filter_fn`` for ``fp8tensor.convert_to_fp8``.

    Converts only the Linears inside the transformer blocks
    (``layers.<i>.attention.w{q,k,v,o}``, ``layers.<i>.feed_forward.w{1,2,3}``);
    the embedding and the output head stay in high precision.
    """
    if not isinstance(module, nn.Linear):
        return False
    parts = fqn.split(".")
    return (
        len(parts) == 4
        and parts[0] == "layers"
        and parts[2] in ("attention", "feed_forward")
        and parts[3] in ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
    )



def block_tp_plan(*, sequence_parallel: bool = True) -> dict:
    """The tensor-parallel plan of one :class:`TransformerBlock`, with PyTorch's own parallel styles.

    ``wq/wk/wv/w1/w3``: ``ColwiseParallel``; ``wo/w2``: ``RowwiseParallel``. With ``sequence_parallel`` the block's
    input and output are the local sequence shard (``Shard(1)``): the norms use ``SequenceParallel`` and
    ``PrepareModuleInput`` all-gathers the sequence before attention / MLP (swap those entries for fp8 gathers with
    ``fp8tensor.parallel.fp8_sequence_parallel_plan``). Without it the block's input is replicated.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if not sequence_parallel:
        return {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
        }
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None),
            desired_input_layouts=(Replicate(), None),
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }

def parallelize_llama(
    model: Llama,
    tp_mesh,
    dp_mesh,
    *,
    sequence_parallel: bool = True,
    mp_policy=None,
    reshard_after_forward: bool = True,
    compile: bool | str = False,
    sp_fp8_comm: bool = False,
    tp_on_one_rank: bool = False,
) -> Llama:
    """Apply tensor parallelism over ``tp_mesh`` and FSDP2 over ``dp_mesh`` (in place).

    Tensor parallel plan (applied only if ``tp_mesh`` has size > 1, or with ``tp_on_one_rank`` on any size: a
    1-rank TP mesh runs the DTensor path on one device, for tests and benchmarks):

    * ``wq/wk/wv/w1/w3``: ``ColwiseParallel`` (output is the local shard, so
      attention sees ``n_heads / tp`` local heads);
      ``wo/w2``: ``RowwiseParallel``.
    * With ``sequence_parallel=True`` the residual stream between blocks is
      sharded along the sequence dim (``Shard(1)``): the norms use
      ``SequenceParallel``, ``PrepareModuleInput`` all-gathers the sequence
      before attention / MLP, and ``wo/w2`` reduce-scatter back to ``Shard(1)``.
      Without it the residual stream is replicated on every TP rank.
    * ``tok_embeddings``: ``RowwiseParallel`` (vocab-sharded table);
      ``output``: ``ColwiseParallel`` with replicated (full) logits.

    ``sp_fp8_comm=True`` (needs ``sequence_parallel`` and a model whose block
    Linears were converted by ``fp8tensor.convert_to_fp8``) swaps the block
    plan's ``PrepareModuleInput`` entries for fp8tensor's
    ``Fp8PrepareModuleInput`` (via ``fp8_sequence_parallel_plan``): the
    sequence all-gathers before attention / MLP then move fp8 data plus
    per-token scales instead of bf16.

    If ``compile`` is true each block is ``torch.compile``-d in place (a string: the
    compile mode, e.g. ``"reduce-overhead"`` for CUDA graphs per block; after
    TP, before FSDP). Then, if ``dp_mesh`` is given, ``fully_shard`` is applied to each
    block and to the root, with ``mp_policy`` (an FSDP2
    ``MixedPrecisionPolicy`` or ``None``). A ``dp_mesh`` of size 1 shards nothing
    but still gives FSDP2's mixed precision (float32 master weights, bf16 compute).

    ``dp_mesh`` / ``tp_mesh`` may be ``None`` to skip that dimension.
    Returns ``model``.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if tp_mesh is not None and (tp_mesh.size() > 1 or tp_on_one_rank):
        tp = tp_mesh.size()
        a = model.args
        for name, n in (("n_heads", a.n_heads), ("n_kv_heads", a.n_kv_heads),
                        ("ffn hidden dim", a.hidden_dim), ("vocab_size", a.vocab_size)):
            if n % tp:
                raise ValueError(f"{name}={n} is not divisible by tp={tp}")

        if sequence_parallel:
            root_plan = {
                "tok_embeddings": RowwiseParallel(
                    input_layouts=Replicate(), output_layouts=Shard(1)
                ),
                "norm": SequenceParallel(),
                "output": ColwiseParallel(
                    input_layouts=Shard(1), output_layouts=Replicate()
                ),
            }
        else:
            root_plan = {
                "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                "output": ColwiseParallel(output_layouts=Replicate()),
            }
        block_plan = block_tp_plan(sequence_parallel=sequence_parallel)
        if sp_fp8_comm:
            if not sequence_parallel:
                raise ValueError("sp_fp8_comm requires sequence_parallel=True")
            from fp8tensor.parallel import fp8_sequence_parallel_plan

            block_plan = fp8_sequence_parallel_plan(block_plan)
        parallelize_module(model, tp_mesh, root_plan)
        for block in model.layers:
            parallelize_module(block, tp_mesh, block_plan)

    if compile:
        mode = compile if isinstance(compile, str) and compile != "default" else None
        for block in model.layers:
            block.compile(mode=mode) if mode else block.compile()

    if dp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        kwargs = {"mesh": dp_mesh}
        if mp_policy is not None:
            kwargs["mp_policy"] = mp_policy
        for block in model.layers:
            fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
        fully_shard(model, **kwargs)
    return model
