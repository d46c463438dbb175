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
    "GroupedExperts",
    "MoE",
    "parallelize_moe_experts",
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
    # mixture of experts (``moe=True``: every block's MLP is a :class:`MoE`)
    moe: bool = False
    n_experts: int = 8
    top_k: int = 2
    moe_hidden: int | None = None  # default: hidden_dim // top_k rounded up to `multiple_of`
    shared_expert: bool = False
    aux_loss_coeff: float = 0.01

    @property
    def expert_hidden_dim(self) -> int:
        if self.moe_hidden is not None:
            return self.moe_hidden
        return self.multiple_of * math.ceil(self.hidden_dim / self.top_k / self.multiple_of)

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

        def heads(t):  # [B, T, local heads, hd]: all heads unsharded, heads/tp under TP (0 tokens: in one process)
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


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts computed with grouped GEMMs (``torch._grouped_mm``), as torchtitan's ``GroupedExperts``.

    Parameters ``w1``, ``w3``: ``[E, hidden, dim]``; ``w2``: ``[E, dim, hidden]`` (``[E, out, in]``, as ``nn.Linear``
    weights stacked). ``forward(x, num_tokens_per_expert)``: ``x`` ``[R, dim]`` holds the routed tokens sorted by
    expert, ``num_tokens_per_expert`` ``[E]`` the group sizes (any, zeros included); returns ``[R, dim]``. With expert
    parallelism the parameters are DTensors sharded on dim 0 and the forward uses their local experts
    (``to_local()``), as torchtitan does. ``fp8tensor.convert_to_fp8`` converts the three weights (fp8 grouped GEMMs).
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2, self.w3))
        offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        dt = torch.bfloat16 if x.is_cuda else x.dtype  # (torch._grouped_mm takes bf16 on CUDA)
        xb = x.to(dt)
        h = F.silu(torch._grouped_mm(xb, w1.to(dt).transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(xb, w3.to(dt).transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, w2.to(dt).transpose(-2, -1), offs=offs).type_as(x)


def _all_to_all(x: torch.Tensor, out_splits: list, in_splits: list, group) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` of the rows of ``x`` (token dispatch / combine, high precision)."""
    from torch.distributed.nn.functional import all_to_all_single

    out = x.new_empty(sum(out_splits), *x.shape[1:])
    return all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)


class MoE(nn.Module):
    """Token-choice top-k mixture of experts: router, :class:`GroupedExperts`, optional shared expert.

    ``forward(x)``: ``[B, T, dim] -> [B, T, dim]``. The router (a ``Linear`` ``dim -> E``, high precision) scores
    every token; each token goes to its ``top_k`` experts, weighted by its softmax probabilities renormalized over
    the chosen ones. Tokens are sorted by expert (``argsort``) and the experts run as grouped GEMMs. The
    load-balancing loss of the last forward (Switch Transformer's ``E * sum_e f_e * p_e``: fraction of routed
    tokens ``f_e`` times mean router probability ``p_e``) is kept in ``self.aux_loss``.

    Expert parallelism (``ep_group`` set by :func:`parallelize_moe_experts`): each rank holds ``E / ep`` experts;
    routed tokens go to the rank of their expert and back with all-to-alls in high precision.
    """

    def __init__(self, args: "ModelArgs"):
        super().__init__()
        self.num_experts, self.top_k = args.n_experts, args.top_k
        self.router = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts = GroupedExperts(args.n_experts, args.dim, args.expert_hidden_dim)
        self.shared_expert = FeedForward(args.dim, args.expert_hidden_dim) if args.shared_expert else None
        self.ep_group = None
        self.aux_loss = torch.zeros(())
        self.eager_experts = False  # True: the experts run outside compiled graphs (exclude_experts_from_compile)

    def _experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        eager = getattr(self, "eager_experts", False)  # (absent from modules pickled before the attribute existed)
        return run_experts_eagerly(self.experts, x, counts) if eager else self.experts(x, counts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        xt = x.reshape(B * T, D)
        probs = F.softmax(self.router(xt).float(), dim=-1)  # [BT, E]
        top_p, top_e = torch.topk(probs, self.top_k, dim=-1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        E = self.num_experts
        flat_e = top_e.flatten()
        # tokens per expert; a fixed-size scatter rather than bincount, whose output size depends on the values
        # (a graph break under torch.compile)
        counts = torch.zeros(E, dtype=torch.long, device=x.device).index_add_(0, flat_e, torch.ones_like(flat_e))
        f = counts.float() / max(1, top_e.numel())
        self.aux_loss = E * (f * probs.mean(0)).sum()
        order = torch.argsort(flat_e, stable=True)
        token_of = order // self.top_k
        routed = xt[token_of]
        if self.ep_group is None:
            out = self._experts(routed, counts)
        else:
            out = self._expert_parallel(routed, counts)
        out = out * top_p.flatten()[order, None].to(out.dtype)
        y = torch.zeros_like(xt).index_add_(0, token_of, out.to(xt.dtype))
        if self.shared_expert is not None:
            y = y + self.shared_expert(xt)
        return y.reshape(B, T, D)

    def _expert_parallel(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        group = self.ep_group
        W = dist.get_world_size(group)
        e_loc = self.num_experts // W
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=group)  # recv[r * e_loc + e]: tokens of rank r for expert e
        in_splits = counts.view(W, e_loc).sum(1).tolist()
        out_splits = recv.view(W, e_loc).sum(1).tolist()
        got = _all_to_all(routed, out_splits, in_splits, group)  # blocks [source rank][local expert]
        rc = recv.view(W, e_loc)
        starts = torch.cumsum(rc.flatten(), 0) - rc.flatten()
        # regroup the received rows by local expert (expert-major), as the grouped GEMM wants them
        idx = torch.cat([torch.arange(int(starts[r * e_loc + e]), int(starts[r * e_loc + e]) + int(rc[r, e]))
                         for e in range(e_loc) for r in range(W)] or [torch.zeros(0, dtype=torch.long)])
        local = self._experts(got[idx], rc.sum(0))
        back = torch.empty_like(local).index_copy_(0, idx, local)
        return _all_to_all(back, in_splits, out_splits, group)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention then SwiGLU MLP."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = MoE(args) if args.moe else FeedForward(args.dim, args.hidden_dim)

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
            ff = layer.feed_forward
            if isinstance(ff, MoE):
                for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv):
                    nn.init.normal_(lin.weight, std=0.02)
                nn.init.normal_(layer.attention.wo.weight, std=depth_std)
                nn.init.normal_(ff.router.weight, std=0.02)
                nn.init.normal_(ff.experts.w1, std=0.02)
                nn.init.normal_(ff.experts.w3, std=0.02)
                nn.init.normal_(ff.experts.w2, std=depth_std)
                if ff.shared_expert is not None:
                    for lin in (ff.shared_expert.w1, ff.shared_expert.w3):
                        nn.init.normal_(lin.weight, std=0.02)
                    nn.init.normal_(ff.shared_expert.w2.weight, std=depth_std)
            else:  # (the dense model's order of random draws)
                for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv, ff.w1, ff.w3):
                    nn.init.normal_(lin.weight, std=0.02)
                for lin in (layer.attention.wo, ff.w2):
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

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of the last forward, summed over the MoE layers and times ``aux_loss_coeff``
        (a float32 scalar; 0 for a dense model)."""
        losses = [layer.feed_forward.aux_loss.float() for layer in self.layers if isinstance(layer.feed_forward, MoE)]
        if not losses:
            return torch.zeros(())
        return torch.stack(losses).sum() * self.args.aux_loss_coeff


def fp8_module_filter(module: nn.Module, fqn: str) -> bool:
    """``module_filter_fn`` for ``fp8tensor.convert_to_fp8``.

    Converts only the Linears inside the transformer blocks
    (``layers.<i>.attention.w{q,k,v,o}``, ``layers.<i>.feed_forward.w{1,2,3}``)
    and, in an MoE model, the grouped experts (``layers.<i>.feed_forward.experts``)
    and the shared expert's Linears; the embedding, the router and the output head stay
    in high precision.
    """
    parts = fqn.split(".")
    if isinstance(module, GroupedExperts):
        return len(parts) == 4 and parts[0] == "layers" and parts[2:] == ["feed_forward", "experts"]
    if not isinstance(module, nn.Linear):
        return False
    if len(parts) == 5 and parts[0] == "layers" and parts[2:4] == ["feed_forward", "shared_expert"]:
        return parts[4] in ("w1", "w2", "w3")
    return (
        len(parts) == 4
        and parts[0] == "layers"
        and parts[2] in ("attention", "feed_forward")
        and parts[3] in ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
    )



def root_tp_plan(*, sequence_parallel: bool = True) -> dict:
    """The tensor-parallel plan of :class:`Llama`'s own modules (apply it to the model; each block takes
    :func:`block_tp_plan` with the same ``sequence_parallel``): ``tok_embeddings`` ``RowwiseParallel`` (a
    vocab-sharded table), ``output`` ``ColwiseParallel`` with replicated (full) logits. With ``sequence_parallel`` the
    embedding's output is the local sequence shard (``Shard(1)``, what the blocks of that plan take), the final
    ``norm`` is ``SequenceParallel`` and ``output`` gathers the sequence. The blocks' plan alone would read the
    replicated embedding output as a sequence shard: wrong results, fp8 or not."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if sequence_parallel:
        return {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }


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


def exclude_experts_from_compile(moe: "MoE") -> None:
    """Run ``moe.experts`` eagerly inside a ``torch.compile``-d block (in place; parameter names unchanged).

    fp8tensor's fp8 grouped-experts modules compile too (docs/moe.md), but on the CPU as masked GEMMs over every
    expert. With this, :class:`MoE` calls its experts through :func:`run_experts_eagerly` (``torch.compiler.disable``),
    so the block's compiled graph breaks around them and they run as in eager mode, fp8 grouped GEMMs included; the
    router, the token permutation, the shared expert and the rest of the block compile. The switch is a plain
    attribute (``moe.eager_experts``), so ``copy.deepcopy`` and ``torch.save`` of the module keep working. bf16 models
    get the same split, so the two compare like for like."""
    moe.eager_experts = True


@torch.compiler.disable
def run_experts_eagerly(experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``experts(x, counts)`` outside any compiled graph (a graph break under ``torch.compile``)."""
    return experts(x, counts)


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
    TP, before FSDP); a MoE block's grouped experts run eagerly inside it
    (:func:`exclude_experts_from_compile`). Then, if ``dp_mesh`` is given, ``fully_shard`` is applied to each
    block and to the root, with ``mp_policy`` (an FSDP2
    ``MixedPrecisionPolicy`` or ``None``). A ``dp_mesh`` of size 1 shards nothing
    but still gives FSDP2's mixed precision (float32 master weights, bf16 compute).

    ``dp_mesh`` / ``tp_mesh`` may be ``None`` to skip that dimension.
    Returns ``model``.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if tp_mesh is not None and (tp_mesh.size() > 1 or tp_on_one_rank):
        tp = tp_mesh.size()
        a = model.args
        for name, n in (("n_heads", a.n_heads), ("n_kv_heads", a.n_kv_heads),
                        ("ffn hidden dim", a.hidden_dim), ("vocab_size", a.vocab_size)):
            if n % tp:
                raise ValueError(f"{name}={n} is not divisible by tp={tp}")

        root_plan = root_tp_plan(sequence_parallel=sequence_parallel)
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
            if isinstance(block.feed_forward, MoE):
                exclude_experts_from_compile(block.feed_forward)
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


def parallelize_moe_experts(model: Llama, ep_mesh, dp_mesh=None, *, mp_policy=None,
                            reshard_after_forward: bool = True) -> Llama:
    """Expert parallelism over ``ep_mesh`` and FSDP2 of the experts over ``dp_mesh`` (in place).

    Each MoE layer's expert weights become DTensors sharded on the expert dim (``Shard(0)``) over ``ep_mesh``; its
    token dispatch and combine become all-to-alls over ``ep_mesh`` (high precision). With ``dp_mesh`` the
    experts are then ``fully_shard`` -ed over it (FSDP2 shards each rank's local experts again; with fp8 master
    weights the all-gather sends fp8 rows and their scales). Call after ``fp8tensor.convert_to_fp8`` or before it.

    Gradients: the all-to-all's backward sums every ep rank's tokens into an expert's gradient and FSDP2 averages
    over ``dp_mesh``: the experts' gradients are ``ep`` times the mean over all ``dp * ep`` ranks. For that mean
    (parameters data-parallel over all ranks), divide them by ``ep`` (with NCCL:
    ``experts.set_gradient_divide_factor(dp * ep)``; gloo has no pre-multiplied sum).
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    for layer in model.layers:
        moe = layer.feed_forward
        if not isinstance(moe, MoE):
            continue
        if moe.num_experts % ep_mesh.size():
            raise ValueError(f"parallelize_moe_experts: {moe.num_experts} experts do not divide over {ep_mesh.size()} "
                             "expert-parallel ranks")
        for name in ("w1", "w2", "w3"):
            p = getattr(moe.experts, name)
            setattr(moe.experts, name, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)]),
                                                    requires_grad=p.requires_grad))
        moe.ep_group = ep_mesh.get_group()
        if dp_mesh is not None:
            from torch.distributed.fsdp import fully_shard

            kw = {} if mp_policy is None else {"mp_policy": mp_policy}
            fully_shard(moe.experts, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, **kw)
    return model
