"""The plain fp8 checkpoint layout (safetensors, Hugging Face ``fbgemm_fp8``): a :class:`ScaledFp8Tensor` entry
``name`` as ``name`` (fp8 data) and ``name + "_scale"`` (float32 row scales; docs/serving.md, "Checkpoints")."""
from __future__ import annotations

import copy
import sys
import warnings
from typing import Mapping, Optional

import torch

from ..core import compat
from ..numerics.quantize import FLOAT8_DTYPES
from ..core.settings import get_config
from ..subclass.tensor import (ScaledFp8Tensor, _is_dtensor, check_finite_rows, local_of, make_scaled, rowwise_dims,
                               validate_parts)

__all__ = ["SCALE_SUFFIX", "plain_state_dict", "load_safetensors", "state_dict_hook", "load_state_dict_pre_hook",
           "check_before_load", "set_hf_quantization_config"]

#: Suffix of the scale entry next to an fp8 entry.
SCALE_SUFFIX = "_scale"


def _split(key: str, t, out: dict, op: str) -> bool:
    """If ``t`` is a ScaledFp8Tensor: ``out[key]`` = its fp8 data, ``out[key + "_scale"]`` = its row scales, True;
    else False. A DTensor of one raises ``NotImplementedError``, another scale layout ``ValueError``."""
    if _is_dtensor(t) and isinstance(local_of(t), ScaledFp8Tensor):
        raise NotImplementedError(
            f"{op}: {key!r} is a DTensor of fp8 shards (a tensor-parallel weight); the plain layout holds whole "
            "tensors. Save sharded fp8 models with torch.distributed.checkpoint (Distributed Checkpoint)")
    if not isinstance(t, ScaledFp8Tensor):
        return False
    if t.scale.shape[-1] != 1 or t.dim() < 2:
        raise ValueError(
            f"{op}: {key!r} is a ScaledFp8Tensor with scale of shape {tuple(t.scale.shape)} for data of shape "
            f"{tuple(t.shape)}; the plain checkpoint layout holds one scale per row (scale shape (..., N, 1))")
    out[key] = t.qdata.contiguous()
    out[key + SCALE_SUFFIX] = t.scale.contiguous()
    return True


def plain_state_dict(state_dict: Mapping[str, object]) -> dict:
    """A copy of ``state_dict`` in the plain fp8 checkpoint layout: every :class:`ScaledFp8Tensor` entry ``name``
    becomes ``name`` (its fp8 data) and ``name + "_scale"`` (float32 row scales); other entries are kept. The new
    dict is ready for ``safetensors.torch.save_file`` or ``save_pretrained(state_dict=...)``.

    ``state_dict``: a ``Module.state_dict()`` (or any mapping of names to tensors).

    Raises ``ValueError`` (an fp8 entry is not scaled per row, or a ``name + "_scale"`` key already exists) or
    ``NotImplementedError`` (an entry is a DTensor of a ScaledFp8Tensor: use ``torch.distributed.checkpoint``).
    """
    op = "fp8tensor.plain_state_dict"
    out: dict = {}
    for key, v in state_dict.items():
        if isinstance(v, ScaledFp8Tensor) and key + SCALE_SUFFIX in state_dict:
            raise ValueError(f"{op}: {key!r} is fp8 but {key + SCALE_SUFFIX!r} is already in the state dict")
        if not _split(key, v, out, op):
            out[key] = v
    return out


def load_safetensors(module: torch.nn.Module, path, *, strict: bool = True):
    """Load a safetensors checkpoint (one file, or every ``*.safetensors`` file of a directory) into ``module`` with
    ``module.load_state_dict(..., strict=strict)``, all files read first (an fp8 entry and its ``_scale`` may lie in
    different shards); returns its ``(missing_keys, unexpected_keys)``. Warns when high-precision entries have another
    dtype than the model's.

    Args: ``module`` (e.g. a ``fp8tensor.quantize_weights`` model), ``path`` (a ``.safetensors`` file or a directory
    holding them), ``strict`` (as in ``Module.load_state_dict``). A parameter the model ties to another (an output
    head sharing the embedding's weight) loads from the entry of whichever of its names the checkpoint holds
    (``save_pretrained`` writes one).

    Raises ``ImportError`` (no safetensors), ``FileNotFoundError`` (no ``.safetensors`` file at ``path``), and what
    ``load_state_dict`` and the load hook raise (``RuntimeError`` / ``ValueError``: missing keys, shapes).
    """
    import pathlib

    from safetensors.torch import load_file

    p = pathlib.Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files or not files[0].is_file():
        raise FileNotFoundError(f"fp8tensor.load_safetensors: no .safetensors file at {str(p)!r}")
    state: dict = {}
    for f in files:
        state.update(load_file(str(f)))
    own = module.state_dict(keep_vars=True)
    # Tied parameters (an output head sharing the embedding's weight): Hugging Face's save_pretrained writes one name
    # of each; the others load from it, as from_pretrained ties them.
    names: dict = {}
    for k, v in own.items():
        names.setdefault(id(v), []).append(k)
    for tied in (ks for ks in names.values() if len(ks) > 1):
        saved = next((k for k in tied if k in state), None)
        for k in tied if saved is not None else ():
            state.setdefault(k, state[saved])
            if saved + SCALE_SUFFIX in state:  # (a plain-layout fp8 entry)
                state.setdefault(k + SCALE_SUFFIX, state[saved + SCALE_SUFFIX])
    # high-precision tensors of another dtype than the model's: load_state_dict casts them
    diff = [(k, v.dtype, own[k].dtype) for k, v in state.items()
            if k in own and v.dtype.is_floating_point and v.dtype not in FLOAT8_DTYPES
            and own[k].dtype.is_floating_point and own[k].dtype not in FLOAT8_DTYPES and v.dtype != own[k].dtype]
    if diff:
        k, saved, model = diff[0]
        warnings.warn(
            f"fp8tensor.load_safetensors: {len(diff)} checkpoint tensors are {saved} where the model's are {model} "
            f"(e.g. {k!r}): load_state_dict casts them and the model computes in {model}, so its outputs differ "
            f"from the saved model's; build the model in {saved} to serve it as saved (Hugging Face: "
            f"AutoModelForCausalLM.from_config(config, dtype={saved}), then quantize_weights)", UserWarning, stacklevel=2)
    return module.load_state_dict(state, strict=strict)


def state_dict_hook(module, state_dict, prefix, local_metadata):
    """State-dict hook of :func:`fp8tensor.quantize_weights` modules: under ``Config.state_dict_fp8 == "plain"``
    their ScaledFp8Tensor entries are written in the plain layout (:func:`plain_state_dict`)."""
    if get_config().state_dict_fp8 != "plain":
        return
    op = "fp8tensor state_dict (state_dict_fp8='plain')"
    refusal = getattr(module, "_fp8_plain_refusal", None)
    if refusal is not None:
        raise ValueError(f"{op}: {refusal}")
    for name in compat.parameters_dict(module):
        _split(prefix + name, state_dict.get(prefix + name), state_dict, op)


def load_state_dict_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                             error_msgs):
    """``Module.register_load_state_dict_pre_hook`` of fp8 modules: a plain-layout entry (``name`` fp8, ``name +
    "_scale"`` float32 row scales) is merged before loading, into a ScaledFp8Tensor for an fp8 weight (bit for bit),
    into ``q * scale`` in the weight's dtype for a high-precision (master) weight.

    Raises ``TypeError`` / ``ValueError`` (naming the key): the scale entry is not float32, does not match the data's
    shape or holds a value that is not finite and positive (as the ``ScaledFp8Tensor`` constructor), a plain fp8 entry
    lacks its scale, or a high-precision entry for an fp8 weight holds an inf or NaN (quantized, its rows would be all
    NaN). Raised before this module's tensors change, ``assign=True`` included; a converted model's
    :func:`check_before_load` runs these checks for all its fp8 modules before any of them loads.
    """
    _check_entries(module, state_dict, prefix, merge=True)


def check_before_load(root, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                      error_msgs) -> None:
    """``Module.register_load_state_dict_pre_hook`` of a converted model (the module ``convert_to_fp8`` or
    ``quantize_weights`` was given): before any module loads, the entries of every fp8 module under it that are in
    their final form are checked as :func:`load_state_dict_pre_hook` checks them (high-precision values for an fp8
    weight: finite; a plain-layout pair: its scales), so such an entry refused leaves the whole model unchanged (a
    failed load of a plain ``nn.Module`` keeps the modules loaded before the failure). An fp8 entry without its
    scales is left to the module's own hook, after the pre-hooks registered later that may rename keys. Keys are the
    root's: the segments of module wrappers whose state-dict hooks drop them (``checkpoint_wrapper``) are dropped
    here too. Raises as that hook does."""
    for name, mod in root.named_modules(remove_duplicate=False):
        if getattr(mod, "_fp8_checkpoint_hooks", False) or getattr(mod, "_fp8_hooks", False):
            for seg in compat.STATE_DICT_HIDDEN_SEGMENTS:
                name = (name + ".").replace(seg, "")[:-1] if name else name
            _check_entries(mod, state_dict, prefix + (name + "." if name else ""), merge=False)


def _check_entries(module, state_dict, prefix, *, merge: bool) -> None:
    """The checks of :func:`load_state_dict_pre_hook` for ``module``'s entries (``merge``: and the merge of each
    plain-layout pair into one entry, in ``state_dict``)."""
    for name, p in compat.parameters_dict(module).items():
        key = prefix + name
        scale = state_dict.get(key + SCALE_SUFFIX)
        q = state_dict.get(key)
        if (isinstance(local_of(p), ScaledFp8Tensor) and isinstance(q, torch.Tensor)
                and not isinstance(local_of(q), ScaledFp8Tensor) and q.dtype.is_floating_point
                and q.dtype not in FLOAT8_DTYPES):  # (high-precision values, quantized by copy_ or after assign)
            check_finite_rows(local_of(q).detach(), f"fp8tensor load_state_dict ({key!r})")
        if not isinstance(q, torch.Tensor) or type(q) is ScaledFp8Tensor or q.dtype not in FLOAT8_DTYPES:
            continue
        local = local_of(p)
        if scale is None:
            if not merge:  # (the model's check before the load: a later pre-hook may still bring the scales)
                continue
            if p is not None and local.dtype not in FLOAT8_DTYPES or isinstance(local, ScaledFp8Tensor):
                raise ValueError(
                    f"fp8tensor load_state_dict: {key!r} is a plain {q.dtype} tensor without its scales "
                    f"{key + SCALE_SUFFIX!r}, so its values are unknown. Load the checkpoint's fp8 data together "
                    "with its scales (all files of a sharded checkpoint at once: fp8tensor.load_safetensors)")
            continue
        orig = local.orig_dtype if isinstance(local, ScaledFp8Tensor) else (
            p.dtype if p is not None and p.dtype not in FLOAT8_DTYPES else torch.float32)
        dims = validate_parts(q, scale, orig, rowwise_dims(q.dim(), -1),  # (a scale that is not finite and > 0 too)
                              f"fp8tensor load_state_dict ({key!r} + {key + SCALE_SUFFIX!r})")
        if not merge:
            continue
        if isinstance(local, ScaledFp8Tensor):
            state_dict[key] = make_scaled(q, scale, orig, True, dims)
        else:  # a high-precision (master) weight: the dequantized values, q * scale, in its dtype
            state_dict[key] = (q.to(torch.float32) * scale).to(orig)
        del state_dict[key + SCALE_SUFFIX]


def set_hf_quantization_config(module: torch.nn.Module) -> Optional[object]:
    """Describe the fp8 weights of a Hugging Face ``PreTrainedModel`` in its ``config.quantization_config`` (docs/
    serving.md, "``from_pretrained``"); returns the quantization config set, or None (a no-op for other modules).

    When every fp8 weight is a 2-D ``float8_e4m3fn`` Linear weight: ``module.config`` becomes a copy with
    ``quantization_config = transformers.FbgemmFp8Config(modules_to_not_convert=[high-precision Linears])``.
    Otherwise every fp8 module refuses ``state_dict()`` in the plain layout (``ValueError`` naming the remedy).
    """
    tf = sys.modules.get("transformers")
    pretrained = getattr(tf, "PreTrainedModel", None) if tf is not None else None
    if pretrained is None or not isinstance(module, pretrained):
        return None
    fp8_mods, hp_linears, representable = [], [], True
    for name, m in module.named_modules():
        fp8_params = [p for p in compat.parameters_dict(m).values() if isinstance(local_of(p), ScaledFp8Tensor)]
        if fp8_params:
            fp8_mods.append(m)
            if not isinstance(m, torch.nn.Linear) or any(
                    p.dim() != 2 or local_of(p).qdata.dtype != torch.float8_e4m3fn for p in fp8_params):
                representable = False
        elif isinstance(m, torch.nn.Linear):
            hp_linears.append(name)
    if not fp8_mods:
        return None
    keep = list(getattr(module, "_keep_in_fp32_modules", None) or ()) + list(
        getattr(module, "_keep_in_fp32_modules_strict", None) or ())
    if keep:  # transformers adds these to modules_to_not_convert: an fp8 Linear among them would load without scales
        fp8_names = [n for n, m in module.named_modules() if any(m is f for f in fp8_mods)]
        if any(n == k or n.endswith("." + k) or n.startswith(k + ".") or k in n.split(".") for n in fp8_names
               for k in keep):
            representable = False
    if not representable:
        for m in fp8_mods:
            m._fp8_plain_refusal = (
                f"{type(module).__name__} holds fp8 weights that a Hugging Face checkpoint cannot describe "
                "(float8_e5m2, fp8 expert weights, or an fp8 Linear among the modules transformers keeps in float32; its "
                "fbgemm_fp8 layout holds e4m3 Linear weights only), "
                "so save_pretrained would write weights that from_pretrained reads without their scales. Save with "
                "safetensors.torch.save_file(fp8tensor.plain_state_dict(model.state_dict()), path) and load with "
                "fp8tensor.load_safetensors into a quantize_weights model")
        return None
    from transformers import FbgemmFp8Config

    old = module.config
    new = copy.deepcopy(old)
    new.quantization_config = FbgemmFp8Config(modules_to_not_convert=sorted(hp_linears))
    for m in module.modules():
        if getattr(m, "config", None) is old:
            m.config = new
    return new.quantization_config
