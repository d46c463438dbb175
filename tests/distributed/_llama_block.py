"""A small Llama-style transformer block and its tensor-parallel plans (test helper, not a test module).

The block is the usual pre-norm decoder layer: ``h = x + Attention(RMSNorm(x))``, ``out = h + MLP(RMSNorm(h))``,
with bias-free ``wq``/``wk``/``wv``/``wo`` projections, causal scaled-dot-product attention and a SwiGLU MLP
(``w2(silu(w1 x) * w3 x)``). Inputs and outputs are ``[batch, seq, hidden]``.

The attention code reshapes with ``-1`` heads, so it runs unchanged on the local head slice that a column-wise
sharded ``wq``/``wk``/``wv`` produces (``use_local_output=True``): the tensor-parallel plans below only use
PyTorch's own parallel styles, nothing of fp8tensor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BlockConfig", "RMSNorm", "Attention", "FeedForward", "LlamaBlock", "tp_plan", "SplitFp8Linear",
           "split_reference"]


class BlockConfig:
    """Sizes of :class:`LlamaBlock`: ``hidden = n_heads * head_dim``; ``ffn`` is the SwiGLU width."""

    def __init__(self, n_heads: int = 4, head_dim: int = 16, ffn: int = 96, eps: float = 1e-6):
        self.n_heads, self.head_dim, self.ffn, self.eps = n_heads, head_dim, ffn, eps
        self.hidden = n_heads * head_dim

    def __repr__(self) -> str:
        return f"BlockConfig(hidden={self.hidden}, n_heads={self.n_heads}, head_dim={self.head_dim}, ffn={self.ffn})"


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x**2, -1) + eps) * weight``, computed in float32 (or float64 for float64 inputs)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype != torch.float64 else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


class Attention(nn.Module):
    """Multi-head causal self-attention with bias-free ``wq``/``wk``/``wv``/``wo``; works on a local head slice."""

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        h = cfg.hidden
        self.wq = nn.Linear(h, h, bias=False)
        self.wk = nn.Linear(h, h, bias=False)
        self.wv = nn.Linear(h, h, bias=False)
        self.wo = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1(x)) * w3(x))``, bias-free."""

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """Pre-norm decoder block: ``h = x + attention(attention_norm(x))``; ``h + feed_forward(ffn_norm(h))``.

    Input and output: ``[batch, seq, hidden]``. Weights are initialized with std ``hidden**-0.5`` (RMSNorm
    weights around 1), so activations stay O(1) through the block.
    """

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.cfg = cfg
        self.attention_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.feed_forward = FeedForward(cfg)
        with torch.no_grad():
            for lin in self.linears():
                lin.weight.normal_(0.0, lin.in_features**-0.5)
            for norm in (self.attention_norm, self.ffn_norm):
                norm.weight.uniform_(0.5, 1.5)

    def linears(self) -> list[nn.Linear]:
        """The six Linear layers (q, k, v, o, w1, w2, w3 — wo and w2 are row-parallel in the plans)."""
        return [m for m in self.modules() if isinstance(m, nn.Linear)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def tp_plan(sequence_parallel: bool, local_output: bool = True) -> dict:
    """The tensor-parallel plan of :class:`LlamaBlock` with PyTorch's parallel styles (Megatron / torchtitan).

    ``wq``/``wk``/``wv``/``w1``/``w3`` column-wise (output features sharded), ``wo``/``w2`` row-wise (input
    features, the GEMM's contraction dim, sharded: each rank contracts its K-slice and the partial sums are
    all-reduced by DTensor).

    With ``sequence_parallel=True`` the block takes and returns the *local sequence shard* ``[b, s_local, h]``:
    the norms run sequence-sharded (``SequenceParallel``), ``PrepareModuleInput`` all-gathers the sequence before
    attention and the MLP, and the row-wise layers reduce-scatter back to ``Shard(1)``. Otherwise the block
    takes and returns full (replicated) ``[b, s, h]`` tensors and the norms are not sharded.

    ``local_output=False`` is the variant for shards of uneven size (a dim not divisible by the mesh size): a
    plain local tensor handed from one style to the next is turned back into a DTensor by ``DTensor.from_local``
    *without* a global shape, which assumes every rank holds the same size, so PyTorch's styles fail on uneven
    shards in high precision too. Here ``w1``/``w3`` return DTensors (any FFN width) and, with sequence
    parallelism, so do ``wo``/``w2`` — then the block takes and returns ``Shard(1)`` DTensors (any sequence
    length). Attention keeps local outputs: each rank must hold whole heads anyway (heads divisible by the mesh).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    mlp_in = {"use_local_output": local_output}
    row_out = {"output_layouts": Shard(1), "use_local_output": local_output} if sequence_parallel else {}
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(**row_out),
        "feed_forward.w1": ColwiseParallel(**mlp_in),
        "feed_forward.w3": ColwiseParallel(**mlp_in),
        "feed_forward.w2": RowwiseParallel(**row_out),
    }
    if sequence_parallel:
        plan.update(
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            }
        )
    return plan


class SplitFp8Linear(nn.Module):
    """Single-device fp8 Linear that quantizes like a tensor-parallel shard would (test reference).

    ``dim=0`` (column-parallel): the weight's rows are cut into ``torch.chunk(n)`` pieces, each piece runs
    :func:`fp8tensor.fp8_linear` and the outputs are concatenated. ``dim=1`` (row-parallel): weight columns and
    input features are cut alike and the per-piece fp8 outputs are summed in rank order (as DTensor's
    Partial -> Replicate all-reduce does). Each piece quantizes its own slice, exactly as each rank does, so a TP
    run must match this module up to float32 rounding.

    ``weights`` says how the weight is held, as in the TP model it mirrors: ``"master"`` (high-precision, quantized
    on use, as after :func:`fp8tensor.convert_to_fp8`), ``"fp8_before"`` (quantized row-wise once, then cut: a
    row-parallel piece keeps its full rows' scales, as :func:`fp8tensor.quantize_weights` before
    ``parallelize_module``) or ``"fp8_after"`` (cut, then each piece quantized on its own: sub-row-wise scales).
    """

    def __init__(self, lin: nn.Linear, n: int, dim: int, recipe: str = "rowwise", weights: str = "master"):
        super().__init__()
        from fp8tensor import ScaledFp8Tensor

        self.n, self.dim, self.recipe = n, dim, recipe
        if weights == "master":
            self.weight = lin.weight
            self.pieces = None
        else:
            w = lin.weight.detach()
            if weights == "fp8_before":
                pieces = torch.chunk(ScaledFp8Tensor.from_hp(w), n, dim)
            elif weights == "fp8_after":
                pieces = [ScaledFp8Tensor.from_hp(c.contiguous()) for c in torch.chunk(w, n, dim)]
            else:
                raise ValueError(f"SplitFp8Linear: unknown weights={weights!r}")
            self.pieces = list(pieces)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from fp8tensor import fp8_linear

        ws = self.pieces if self.pieces is not None else torch.chunk(self.weight, self.n, self.dim)
        if self.dim == 0:
            return torch.cat([fp8_linear(x, w, recipe=self.recipe) for w in ws], dim=-1)
        xs = torch.split(x, [w.shape[1] for w in ws], dim=-1)
        out = fp8_linear(xs[0], ws[0], recipe=self.recipe)
        for xi, wi in zip(xs[1:], ws[1:]):
            out = out + fp8_linear(xi, wi, recipe=self.recipe)
        return out


ROW_PARALLEL = ("wo", "w2")


def split_reference(block: LlamaBlock, n: int, recipe: str = "rowwise", weights: str = "master") -> LlamaBlock:
    """Swap every Linear of ``block`` (in place) for a :class:`SplitFp8Linear` cut as in :func:`tp_plan` over
    ``n`` ranks (``wo``/``w2`` row-wise, the others column-wise). Returns ``block``."""
    for parent in (block.attention, block.feed_forward):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, SplitFp8Linear(child, n, 1 if name in ROW_PARALLEL else 0, recipe, weights))
    return block
