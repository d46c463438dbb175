"""torchtitan integration (torchtitan 0.3.0, which converts models on their config tree, before they are built):
:class:`Fp8TensorLinear` and :class:`Fp8TensorGroupedExperts` (torchtitan's ``Linear`` / ``GroupedExperts`` converted by
:func:`fp8tensor.convert_to_fp8` when built), :class:`Fp8TensorConverter` (a ``ModelConfigConverter`` swapping their
configs), :func:`llama3_debugmodel_fp8tensor`, and the ``--override.imports`` entries :func:`fp8tensor_linear` /
:func:`fp8tensor_linear_layers`. See docs/torchtitan.md. Imports without torchtitan; its classes then raise
``ImportError`` when used."""
from __future__ import annotations

from dataclasses import field
from typing import Any

from .conversion.convert import Fp8GroupedExpertsMixin, Fp8LinearMixin, convert_to_fp8, fp8_size_choice
from .training.recipes import get_recipe

__all__ = ["Fp8TensorLinear", "Fp8TensorGroupedExperts", "Fp8TensorConverter", "convert_model_config",
           "llama3_debugmodel_fp8tensor", "fp8tensor_linear", "fp8tensor_linear_layers"]

TORCHTITAN_VERSION = "0.3.0"  # the version this module is written and tested against

try:
    from dataclasses import dataclass

    from torchtitan.components.quantization import QuantizationConverter
    from torchtitan.config.override import derive, override
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts
except ImportError as e:  # torchtitan (or one of its import-time dependencies) missing
    _IMPORT_ERROR: ImportError | None = e
else:
    _IMPORT_ERROR = None


def _selected(config: Any, fqn: str, filter_fqns: list[str], cls: type, dims: tuple) -> bool:
    """A plain ``cls`` config (subclasses have their own forward) whose ``dims`` are multiples of 16 (fp8 GEMMs),
    with an FQN containing none of ``filter_fqns``."""
    return (type(config) is cls and all(getattr(config, d) % 16 == 0 for d in dims)
            and not any(f in fqn for f in filter_fqns))


def _build(module, base: type, config, dims: tuple, got: str, keep: str) -> None:
    """``base.__init__(module, config)`` then :func:`convert_to_fp8`; ``ValueError`` unless ``dims`` are multiples
    of 16 (``got``: their values, ``keep``: the config to use instead)."""
    if any(getattr(config, d) % 16 for d in dims):
        raise ValueError(f"{type(module).__name__}: {' and '.join(dims)} must be multiples of 16 (fp8 GEMMs), got "
                         f"{got}; keep {keep}")
    base.__init__(module, config)
    convert_to_fp8(module, recipe=config.recipe, size_rule=False)


if _IMPORT_ERROR is None:

    class Fp8TensorLinear(Fp8LinearMixin, Linear):
        """torchtitan ``Linear`` trained in fp8 by fp8tensor (built from :class:`Fp8TensorLinear.Config`).

        ``weight``: ``(out_features, in_features)`` of the model dtype, converted by :func:`fp8tensor.convert_to_fp8`
        when built (its ``fp8_all_gather`` rule); ``forward(input)``: ``(*, in_features)`` -> ``(*, out_features)``
        through :func:`fp8tensor.fp8_linear` with ``config.recipe``. ``state_dict()`` holds the plain weight.

        Raises ``ValueError``: ``in_features`` or ``out_features`` not a multiple of 16; unknown ``recipe``.
        """

        _fp8_base = Linear

        @dataclass(kw_only=True, slots=True)
        class Config(Linear.Config):
            recipe: str = "rowwise"
            """fp8tensor recipe: ``"rowwise"`` (3 fp8 GEMMs) or ``"rowwise_gw_hp"`` (grad_weight high precision)."""

        def __init__(self, config: Config):
            _build(self, Linear, config, ("in_features", "out_features"),
                   f"{config.in_features} -> {config.out_features}", "this Linear a Linear.Config")

    class Fp8TensorGroupedExperts(Fp8GroupedExpertsMixin, GroupedExperts):
        """torchtitan ``GroupedExperts`` trained in fp8 by fp8tensor (built from its ``Config``): ``w1_EFD`` /
        ``w3_EFD`` ``(E, hidden_dim, dim)`` and ``w2_EDF`` ``(E, dim, hidden_dim)`` are
        :class:`~fp8tensor.Fp8MasterWeight` s, each ``torch._grouped_mm`` of ``forward`` runs the fp8 grouped GEMMs
        of ``config.recipe``; ``state_dict()`` holds the plain weights.

        Raises ``ValueError``: ``dim`` or ``hidden_dim`` not a multiple of 16; unknown ``recipe``.
        """

        _fp8_base = GroupedExperts

        @dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            recipe: str = "rowwise"
            """fp8tensor recipe: ``"rowwise"`` (3 fp8 GEMMs) or ``"rowwise_gw_hp"`` (grad_weight high precision)."""

        def __init__(self, config: Config):
            _build(self, GroupedExperts, config, ("dim", "hidden_dim"), f"{config.dim} and {config.hidden_dim}",
                   "these experts a GroupedExperts.Config")

    class Fp8TensorConverter(QuantizationConverter):
        """Swap every selected ``Linear.Config`` of a torchtitan model config for :class:`Fp8TensorLinear.Config`.

        Selected: plain ``Linear.Config`` nodes with dims multiples of 16 whose FQN contains none of ``filter_fqns``
        (as torchao's float8 converter), and plain ``GroupedExperts.Config`` nodes with dims multiples of 16 (which
        become :class:`Fp8TensorGroupedExperts.Config`).

        Raises ``ValueError``: unknown ``recipe`` (when the converter is built).
        """

        @dataclass(kw_only=True, slots=True)
        class Config(QuantizationConverter.Config):
            recipe: str = "rowwise"
            """``"rowwise"`` (forward, grad_input and grad_weight in fp8) or ``"rowwise_gw_hp"``."""

            filter_fqns: list[str] = field(default_factory=list)
            """Linears whose FQN contains one of these strings stay in high precision (e.g. ``["lm_head"]``)."""

            size_rule: bool = False
            """The size-aware choice (:func:`fp8tensor.recipes.fp8_size_choice`), as ``convert_to_fp8(...,
            size_rule=True)``."""

        def __init__(self, config: Config):
            get_recipe(config.recipe)  # ValueError naming the known recipes
            self.config = config

        def convert(self, model_config):
            return convert_model_config(model_config, recipe=self.config.recipe, filter_fqns=self.config.filter_fqns,
                                        size_rule=self.config.size_rule)

    def convert_model_config(model_config, *, recipe: str = "rowwise", filter_fqns: list[str] | None = None,
                             size_rule: bool = False):
        """Replace the selected ``Linear.Config`` nodes of ``model_config`` (in place) by
        :class:`Fp8TensorLinear.Config` and the selected ``GroupedExperts.Config`` nodes by
        :class:`Fp8TensorGroupedExperts.Config`; returns the (possibly replaced) root config. ``size_rule``: each
        Linear's recipe from :func:`fp8tensor.recipes.fp8_size_choice` (None: the node is left in high precision)."""
        get_recipe(recipe)
        filter_fqns = list(filter_fqns or [])
        nodes = [(n, Fp8TensorLinear.Config) for n in model_config.traverse(Linear.Config)
                 if _selected(n[1], n[0], filter_fqns, Linear.Config, ("in_features", "out_features"))]
        nodes += [(n, Fp8TensorGroupedExperts.Config) for n in model_config.traverse(GroupedExperts.Config)
                  if _selected(n[1], n[0], filter_fqns, GroupedExperts.Config, ("dim", "hidden_dim"))]
        for (fqn, cfg, parent, attr), target in nodes:
            node_recipe = recipe
            if size_rule and target is Fp8TensorLinear.Config:
                choice = fp8_size_choice(cfg.in_features, cfg.out_features, recipe)
                if choice is None:
                    continue
                node_recipe = choice.name
            new = derive(cfg, target, recipe=node_recipe)
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
        return model_config

    def _override_factory(cfg, *, recipe: str = "rowwise"):
        get_recipe(recipe)
        if cfg.in_features % 16 or cfg.out_features % 16:
            return cfg
        return derive(cfg, Fp8TensorLinear.Config, recipe=recipe)

    @override(target=Linear.Config, exact=True, description="fp8tensor: row-wise fp8 training of every Linear")
    def fp8tensor_linear(cfg, *, recipe: str = "rowwise"):
        """torchtitan override (``--override.imports fp8tensor.torchtitan.fp8tensor_linear``): every plain
        ``Linear`` with dims multiple of 16 becomes :class:`Fp8TensorLinear` with ``recipe``."""
        return _override_factory(cfg, recipe=recipe)

    # fqns: "layers.0.…" from the model config, "model_spec.model.layers.0.…" from the trainer's
    @override(target=Linear.Config, exact=True, fqns=["*layers.*"],
              description="fp8tensor: row-wise fp8 training of the transformer blocks' Linears (lm_head stays)")
    def fp8tensor_linear_layers(cfg, *, recipe: str = "rowwise"):
        """As :func:`fp8tensor_linear`, for the Linears under ``layers.*`` only (``lm_head`` stays high precision)."""
        return _override_factory(cfg, recipe=recipe)

    def llama3_debugmodel_fp8tensor():
        """torchtitan's ``llama3_debugmodel`` trainer config with :class:`Fp8TensorConverter` (``lm_head`` stays
        high precision): ``--module fp8tensor.torchtitan --config llama3_debugmodel_fp8tensor``."""
        from torchtitan.models.llama3 import model_registry
        from torchtitan.models.llama3.config_registry import llama3_debugmodel

        config = llama3_debugmodel()
        converter = Fp8TensorConverter.Config(filter_fqns=["lm_head"])
        config.model_spec = model_registry("debugmodel", converters=[converter])
        return config

else:

    def __getattr__(name: str):
        if name in __all__:
            raise ImportError(
                f"fp8tensor.torchtitan.{name} needs torchtitan {TORCHTITAN_VERSION} importable "
                f"({type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}). Install it with "
                f"`pip install torchtitan=={TORCHTITAN_VERSION}` (docs/torchtitan.md lists the minimal set of "
                "dependencies); fp8tensor.convert_to_fp8 works without it.") from _IMPORT_ERROR
        raise AttributeError(f"module 'fp8tensor.torchtitan' has no attribute {name!r}")

