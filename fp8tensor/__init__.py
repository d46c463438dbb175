"""fp8tensor: row-wise scaled fp8 matmuls as a tensor subclass that lives inside DTensor and FSDP2.

Public API:

* :class:`ScaledFp8Tensor` — fp8 data + float32 row-wise scales; ``ScaledFp8Tensor.from_hp(w)``.
* :func:`convert_to_fp8` — training: high-precision master weights quantized on use (recipes
  ``"rowwise"`` and ``"rowwise_gw_hp"``).
* :func:`quantize_weights` — inference / frozen weights stored in fp8.
* :func:`fp8_linear` — the functional form of an fp8 Linear.
* :func:`plain_state_dict` / :func:`load_safetensors` — fp8 weights as plain ``weight`` + ``weight_scale`` tensors
  (safetensors, Hugging Face; inside ``with fp8tensor.config(state_dict_fp8="plain"):`` ``state_dict()`` writes them),
  see ``docs/serving.md``. ``torch.export`` of fp8 models works as for any model (``docs/serving.md``).
* :func:`fp8_grouped_mm` — fp8 ``torch._grouped_mm`` for mixture-of-experts weights (``docs/moe.md``); master
  weights and ScaledFp8Tensors of 3-D expert weights route ``torch._grouped_mm`` to it.
* :func:`set_gemm_backend` / :func:`gemm_backend` — GEMM backend choice.
* :func:`config` / :func:`set_config` / :func:`get_config` — the library's settings (:class:`Config`).
* :func:`graph_step` — a training step's forward + backward captured as one CUDA graph (no host waits).
* :class:`Fp8PrepareModuleInput` / :func:`fp8_sequence_parallel_plan` — fp8 all-gather of sequence-parallel
  activations (per-token scales), see ``docs/sp_fp8.md``.
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
    """``fp8tensor.<module>`` names each module by its flat name too (``fp8tensor.quantize``, ``fp8tensor.linear``,
    ...: the layout before the layer folders), so imports, monkeypatches and pickles that name them keep working;
    ``fp8tensor.fsdp`` is ``fp8tensor.numerics.fsdp_payload``."""
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
