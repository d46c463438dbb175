"""The Llama block of ``examples/llama.py`` in the configuration the distributed tests use, and its tensor-parallel
plans (test helper, not a test module).

:class:`LlamaBlock` is ``llama.TransformerBlock`` (the one definition of the block: pre-norm decoder layer
``h = x + Attention(RMSNorm(x))``, ``out = h + MLP(RMSNorm(h))``, bias-free ``wq``/``wk``/``wv``/``wo``, causal
scaled-dot-product attention and a SwiGLU MLP) without rotary embeddings, with as many key/value heads as query
heads and an initialization that keeps activations O(1). Inputs and outputs are ``[batch, seq, hidden]``.

The attention code reshapes with ``-1`` heads, so it runs unchanged on the local head slice that a column-wise
sharded ``wq``/``wk``/``wv`` produces (``use_local_output=True``): the tensor-parallel plans below only use
PyTorch's own parallel styles, nothing of fp8tensor.
"""
from __future__ import annotations

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

from llama import Attention, FeedForward, ModelArgs, RMSNorm, TransformerBlock  # noqa: E402

__all__ = ["BlockConfig", "RMSNorm", "Attention", "FeedForward", "LlamaBlock", "tp_plan", "SplitFp8Linear",
           "split_reference"]


class BlockConfig:
    """Sizes of :class:`LlamaBlock`: ``hidden = n_heads * head_dim``; ``ffn`` is the SwiGLU width."""

    def __init__(self, n_heads: int = 4, head_dim: int = 16, ffn: int = 96, eps: float = 1e-6):
        self.n_heads, self.head_dim, self.ffn, self.eps = n_heads, head_dim, ffn, eps
        self.hidden = n_heads * head_dim

    def model_args(self) -> ModelArgs:
        """The ``llama.ModelArgs`` of this block (no grouped-query attention)."""
        return ModelArgs(dim=self.hidden, n_layers=1, n_heads=self.n_heads, n_kv_heads=self.n_heads,
                         ffn_hidden=self.ffn, norm_eps=self.eps)

    def __repr__(self) -> str:
        return f"BlockConfig(hidden={self.hidden}, n_heads={self.n_heads}, head_dim={self.head_dim}, ffn={self.ffn})"


class LlamaBlock(TransformerBlock):
    """``llama.TransformerBlock`` without rotary embeddings: ``forward(x)``, ``[batch, seq, hidden]`` in and out.

    Weights are initialized with std ``in_features**-0.5`` (RMSNorm weights uniform in [0.5, 1.5]), so activations
    stay O(1) through the block.
    """

    def __init__(self, cfg: BlockConfig):
        super().__init__(0, cfg.model_args())
        self.cfg = cfg
        with torch.no_grad():
            for lin in self.linears():
                lin.weight.normal_(0.0, lin.in_features**-0.5)
            for norm in (self.attention_norm, self.ffn_norm):
                norm.weight.uniform_(0.5, 1.5)

    def linears(self) -> list[nn.Linear]:
        """The seven Linear layers (q, k, v, o, w1, w2, w3 — wo and w2 are row-parallel in the plans)."""
        return [m for m in self.modules() if isinstance(m, nn.Linear)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The attention takes one input (no rope table), as the plans' PrepareModuleInput expects.
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
