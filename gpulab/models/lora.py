"""How many parameters LoRA adds, and to which layers: the one LoRA size formula of the library
(``gpulab.fit``'s LoRA lever and lesson 11 both use it).

``targeted_linears`` reads the adapted layers off a model built on the meta device, matching
names as peft does; ``adapter_params`` sums ``formulas.lora_params`` over them;
``default_targets`` is peft's default choice for the config's model type."""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from gpulab import formulas as F
from gpulab.models import hf_configs

__all__ = ["DEFAULT_TARGETS", "adapter_params", "check_targets", "default_targets", "is_target", "linear_shape",
           "targeted_linears"]

DEFAULT_TARGETS = ("q_proj", "v_proj")
# peft's default targets where they are not q_proj / v_proj (peft/utils/constants.py
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING): GPT-2's fused q/k/v projection
_PEFT_DEFAULTS = {"gpt2": ("c_attn",)}


def default_targets(config: Any) -> tuple[str, ...]:
    """The layers peft adapts when none are named, for this config's model type."""
    return _PEFT_DEFAULTS.get(getattr(config, "model_type", ""), DEFAULT_TARGETS)


def check_targets(targets: Sequence[str]) -> tuple[str, ...]:
    if isinstance(targets, str) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"targets must be a non-empty list of module names such as ('q_proj', 'v_proj'), "
                         f"got {targets!r}")
    return tuple(targets)


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of a layer LoRA and bitsandbytes treat as a linear layer: an
    ``nn.Linear``, or transformers' ``Conv1D`` (GPT-2's projections), whose weight is stored
    (in, out) (transformers/pytorch_utils.py; transformers/integrations/bitsandbytes.py reads
    ``in_features, out_features = module.weight.shape`` for it). None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    from transformers.pytorch_utils import Conv1D
    if isinstance(module, Conv1D):
        i, o = module.weight.shape
        return int(i), int(o)
    return None


def is_target(name: str, targets: Sequence[str]) -> bool:
    # peft/tuners/tuners_utils.py ``check_target_module_exists`` for a list of names
    return name in targets or any(name.endswith("." + t) for t in targets)


def targeted_linears(config_or_name: Any, targets: Sequence[str] = DEFAULT_TARGETS) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of every linear layer (``linear_shape``) LoRA adapts:
    those whose name is a target or ends in ``.target``, as peft matches a list of target modules
    (peft/tuners/tuners_utils.py ``check_target_module_exists``: ``key.endswith(f".{target_key}")``).
    Read off a model built on the meta device."""
    targets = check_targets(targets)
    config, shown = hf_configs.config_and_name(config_or_name)
    with torch.device("meta"):
        model = hf_configs.build_causal_lm(config)
    found = [(n, *shape) for n, m in model.named_modules()
             if is_target(n, targets) and (shape := linear_shape(m)) is not None]
    if not found:
        raise ValueError(f"no linear layer of {shown} is named {', '.join(targets)}")
    return found


def adapter_params(config_or_name: Any, rank: int = 8, targets: Sequence[str] = DEFAULT_TARGETS) -> int:
    """Trainable parameters LoRA adds: ``gpulab.formulas.lora_params(in, out, rank)`` summed over
    the targeted Linear layers."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank must be a positive whole number, got {rank!r}")
    return F.lora_trainable_params([(i, o) for _, i, o in targeted_linears(config_or_name, targets)], rank)

