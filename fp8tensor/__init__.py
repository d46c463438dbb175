"""fp8tensor: row-wise scaled fp8 matmuls as a tensor subclass that lives inside DTensor and FSDP2.

Public API: :class:`ScaledFp8Tensor` (fp8 data + float32 row-wise scales, ``ScaledFp8Tensor.from_hp(w)``);
:func:`convert_to_fp8` (training with high-precision master weights quantized on use); :func:`quantize_weights`
(inference / frozen weights stored in fp8); :func:`fp8_linear`; :func:`plain_state_dict` / :func:`load_safetensors`
(the plain ``weight`` + ``weight_scale`` layout, docs/serving.md); :func:`fp8_grouped_mm` (mixture-of-experts,
docs/moe.md); :func:`set_gemm_backend` / :func:`gemm_backend`; :func:`config` / :func:`set_config` /
:func:`get_config` (:class:`Config`); :func:`graph_step` (a training step as one CUDA graph);
:class:`Fp8PrepareModuleInput` / :func:`fp8_sequence_parallel_plan` (fp8 sequence-parallel all-gather, docs/sp_fp8.md).
"""
from .core.settings import Config, config, get_config, set_config
from .numerics.quantize import E4M3, E5M2, quantize_rowwise
from .subclass.tensor import ScaledFp8Tensor, dequantize
from .subclass import ops  # registers the non-GEMM op table entries
from .subclass.gemm import BACKENDS, gemm_backend, get_gemm_backend, set_gemm_backend
from .training.recipes import Recipe, RECIPES
from .training.linear import fp8_linear
from .training.grouped import fp8_grouped_mm
from .training.master import Fp8MasterWeight
from .distributed import fsdp_state  # FSDP2 state for conversion after fully_shard
from .distributed import collectives  # fp8 collectives for DTensor / TP
from .conversion.convert import convert_to_fp8, quantize_weights
from .conversion.checkpoint import load_safetensors, plain_state_dict
from .training.graphs import GraphedStep, graph_step

#: Modules imported for what they register (op table entries, collective handlers) or hold, not for names.
_REGISTERING = (ops, fsdp_state, collectives)


def _alias_modules() -> None:
    """Each module also as ``fp8tensor.<flat name>`` (the layout before the layer folders: imports and pickles name
    it); ``fp8tensor.fsdp`` is ``fp8tensor.numerics.fsdp_payload``."""
    import importlib
    import pkgutil
    import sys

    for layer in ("core", "numerics", "subclass", "training", "distributed", "conversion"):
        for info in pkgutil.iter_modules(importlib.import_module(f"{__name__}.{layer}").__path__):
            try:
                mod = importlib.import_module(f"{__name__}.{layer}.{info.name}")
            except ImportError:  # pragma: no cover - parallel needs torch.distributed
                continue
            flat = "fsdp" if info.name == "fsdp_payload" else info.name
            sys.modules.setdefault(f"{__name__}.{flat}", mod)
            globals().setdefault(flat, mod)


_alias_modules()

__all__ = ["Fp8MasterWeight", "Recipe", "RECIPES", "fp8_linear", "fp8_grouped_mm", "convert_to_fp8", "quantize_weights",
           "ScaledFp8Tensor", "dequantize", "quantize_rowwise", "E4M3", "E5M2", "BACKENDS", "gemm_backend",
           "get_gemm_backend", "set_gemm_backend", "GraphedStep", "graph_step", "Config", "config", "get_config",
           "set_config", "plain_state_dict", "load_safetensors"]
try:  # fp8 sequence-parallel communication (needs torch.distributed)
    from .distributed.parallel import Fp8PrepareModuleInput, fp8_sequence_all_gather, fp8_sequence_parallel_plan

    __all__ += ["Fp8PrepareModuleInput", "fp8_sequence_all_gather", "fp8_sequence_parallel_plan"]
except ImportError:  # pragma: no cover - torch builds without distributed
    pass
__version__ = "0.1.0"
