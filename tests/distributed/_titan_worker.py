"""Worker of tests/distributed/test_torchtitan.py: torchtitan 0.3.0's own Llama3 debug model, TP sharding (sequence
parallel) and FSDP2 (bf16 mixed precision), trained a few AdamW steps on gloo, with fp8tensor applied in one of the
conversion orders. Everything model- and parallelism-related is torchtitan's code; the test only builds the pieces
its Trainer would (the Trainer itself needs the dataset/tensorboard stack, which the llama3 path does not).

Orders:
  ``hp``         no conversion (the high-precision reference);
  ``converter``  :class:`fp8tensor.torchtitan.Fp8TensorConverter` on the config, before the model is built;
  ``after_tp``   ``convert_to_fp8`` after torchtitan's TP (``Module.parallelize``), before its FSDP2;
  ``after_both`` ``convert_to_fp8`` after torchtitan's ``parallelize_llama`` (TP + FSDP2), before init;
  ``after_init`` ``convert_to_fp8`` after parallelize_llama and weight initialization (a real, sharded model).
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from conftest import count_scaled_mm  # noqa: E402  (tests/ is on sys.path: pytest rootdir / the spawn harness)

SKIP = ["lm_head"]
_DIMS: dict = {}



def _build(order: str, tp: int, backend: str, world: int):
    from torchtitan.config import ParallelismConfig, TORCH_DTYPE_MAP, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry, parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    import fp8tensor
    from fp8tensor.torchtitan import Fp8TensorConverter

    converters = [Fp8TensorConverter.Config(filter_fqns=SKIP)] if order == "converter" else None
    spec = model_registry("debugmodel", converters=converters)
    cfg = spec.model
    for layer in cfg.layers:
        # torchtitan's causal SDPA (flex attention would compile on CPU); one document per sequence, so exact.
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    parallelism = ParallelismConfig(
        tensor_parallel_degree=tp, spmd_backend=backend, enable_sequence_parallel=True
    )
    training = TrainingConfig(local_batch_size=2, seq_len=64, mixed_precision_param="bfloat16")
    # What Llama3Model.Config.update_from_config does for TP (it also imports torchtitan.trainer, whose data stack
    # the llama3 path does not need).
    set_llama3_sharding_config(cfg, enable_sp=parallelism.enable_sequence_parallel)
    import torchtitan.distributed.parallel_dims as pd

    pd.device_type = "cpu"  # torchtitan picks "cuda" when no accelerator is present; gloo meshes here are CPU
    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_spmd_backend(backend)  # as torchtitan's Trainer does
    key = (tp, backend, world)
    if key not in _DIMS:  # one ParallelDims (and meshes) per process: torchtitan caches meshes globally
        _DIMS[key] = ParallelDims.from_config(parallelism, world)
    dims = _DIMS[key]
    with torch.device("meta"):
        model = cfg.build()
    model.verify_module_protocol()

    def convert():
        fp8tensor.convert_to_fp8(model, module_filter_fn=lambda m, fqn: not any(s in fqn for s in SKIP))

    if order == "after_tp":
        # parallelize_llama's steps, with the conversion between torchtitan's TP (Module.parallelize: per-instance
        # forward wrappers around the captured bound forward) and its FSDP2.
        from torchtitan.distributed.full_dtensor import resolve_fsdp_mesh, validate_config

        if backend in ("full_dtensor", "spmd_types"):
            validate_config(dims, model)
        model.parallelize(dims)
        convert()
        if backend in ("full_dtensor", "spmd_types"):
            dp_mesh, dp_mesh_dims = resolve_fsdp_mesh(dims)
        else:
            dp_mesh, dp_mesh_dims = dims.get_mesh(["fsdp"]), None
        apply_fsdp_to_decoder(
            model,
            dp_mesh,
            param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
            pp_enabled=False,
            dp_mesh_dims=dp_mesh_dims,
        )
    else:
        parallelize_llama(
            model,
            parallel_dims=dims,
            training=training,
            parallelism=parallelism,
            compile_config=_no_compile(),
            ac_config=None,  # activation checkpointing would recompute forward GEMMs (and change the count)
            dump_folder="/tmp",
        )
        if order == "after_both":
            convert()
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):  # gloo has no PREMUL_SUM: sum, then divide (same result on NCCL's path)
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    if order == "after_init":
        convert()
    model.train()
    return model, dims


def _no_compile():
    from torchtitan.config import CompileConfig

    return CompileConfig(enable=False)


def _local(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train_one(rank: int, world: int, order: str, tp: int, backend: str, steps: int, seed: int) -> dict:
    import warnings

    from fp8tensor.convert import Fp8LinearMixin

    torch.manual_seed(1234)  # same initial weights in every order (torchtitan's DTensor init follows the seed)
    from torchtitan.distributed import utils as dist_utils

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        model, dims = _build(order, tp, backend, world)
    ctx = dist_utils.get_spmd_context(parallel_dims=dims)  # the Trainer's train_context
    warn = [str(x.message) for x in w if "fp8tensor" in str(x.message) or "convert_to_fp8" in str(x.message)]
    converted = [fqn for fqn, m in model.named_modules() if isinstance(m, Fp8LinearMixin)]
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4)
    dp = world // tp
    dp_rank = rank // tp
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 2048, (steps, 2 * dp, 65), generator=g)
    losses, gemms = [], []
    for step in range(steps):
        batch = data[step, 2 * dp_rank : 2 * dp_rank + 2]
        tokens, labels = batch[:, :-1], batch[:, 1:]
        if backend == "spmd_types":
            from torchtitan.distributed.spmd_types import annotate_input_spmd_types

            tokens, labels, _ = annotate_input_spmd_types(dims, tokens, labels, {})
        elif backend == "full_dtensor":
            from torchtitan.distributed import full_dtensor

            tokens, labels, _ = full_dtensor.parallelize_inputs(dims, tokens, labels, {})
        with ctx(), count_scaled_mm() as n:
            logits = model(tokens)
            loss = F.cross_entropy(_local(logits).float().flatten(0, 1), _local(labels).flatten())
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        gl = loss.detach().clone()
        torch.distributed.all_reduce(gl)
        losses.append(gl.item() / world)
        gemms.append(n[0])
    return {"losses": losses, "gemms": gemms, "converted": converted, "warnings": warn}


def train(rank: int, world: int, orders: tuple, tp: int, backend: str, steps: int, seed: int) -> dict:
    """For each order: train ``steps`` AdamW steps on the same data from the same initial weights; return per
    order the mean loss per step, fp8 GEMMs per step on this rank, the converted Linears' FQNs and the warnings."""
    import fp8tensor

    fp8tensor.convert_to_fp8(torch.nn.Linear(16, 16))(torch.randn(2, 16))  # the one-time CPU _scaled_mm probe
    return {order: _train_one(rank, world, order, tp, backend, steps, seed) for order in orders}
