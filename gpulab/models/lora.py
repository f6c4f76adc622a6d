"""How many parameters LoRA adds, and to which layers: the one LoRA size formula of the library
(``gpulab.fit``'s LoRA lever and lesson 11 both use it).

``targeted_linears`` reads the adapted layers off a model built on the meta device, matching
names as peft does; ``adapter_params`` sums ``formulas.lora_params`` over them;
``default_targets`` is peft's default choice for the config's model type."""
from __future__ import annotations

import logging
import warnings
from typing import Any, Sequence

import torch
from torch import nn

from gpulab import formulas as F
from gpulab.models import hf_configs
from gpulab.options import LORA_DTYPES, check_lora_dtype, check_rank, check_targets   # torch-free: the CLI's checks

__all__ = ["DEFAULT_TARGETS", "LORA_DTYPES", "adapter_params", "check_adapters", "check_lora_dtype", "check_rank",
           "check_targets", "default_targets", "import_peft", "is_target", "linear_shape", "rank_refusal",
           "targeted_linears", "wrap_lora"]

DEFAULT_TARGETS = ("q_proj", "v_proj")
# the adapters' dtype: "fp32", peft's default (get_peft_model(autocast_adapter_dtype=True) upcasts
# fp16/bf16 adapters to float32: peft/tuners/tuners_utils.py cast_adapter_dtype), or "base", the
# dtype the model is built in (torchtune's LoRALinear on a bf16 model; peft with
# autocast_adapter_dtype=False on a float base, whose dtype its adapters take)
# peft's default targets where they are not q_proj / v_proj (peft/utils/constants.py
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING): GPT-2's fused q/k/v projection, BERT's and
# T5's own names for the query and value projections
_PEFT_DEFAULTS = {"gpt2": ("c_attn",), "bert": ("query", "value"), "t5": ("q", "v")}


def default_targets(config: Any) -> tuple[str, ...]:
    """The layers peft adapts when none are named, for this config's model type."""
    return _PEFT_DEFAULTS.get(getattr(config, "model_type", ""), DEFAULT_TARGETS)


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


def check_adapters(model: nn.Module, shown: str, rank: int, targets: Sequence[str]) -> None:
    """Refuse, in one line naming the option and its value, targets that name no linear layer of
    ``model`` (built on the meta device: its names and shapes are all that is read), listing the
    names it has, and a rank above the smaller side of a targeted layer (``rank_refusal``)."""
    linears = [(n, *shape) for n, m in model.named_modules() if (shape := linear_shape(m)) is not None]
    found = [t for t in linears if is_target(t[0], targets)]
    if not found:
        names = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n, _, _ in linears))
        have = (f"its linear layers are named {', '.join(names[:16])}{', ...' if len(names) > 16 else ''}" if names
                else "it has no linear layer")
        raise ValueError(f"lora_targets (--lora-targets) {' '.join(targets)}: no linear layer of {shown} is named "
                         f"{', '.join(targets)}; {have}: name the layers to adapt as the model calls them")
    name, i, o = min(found, key=lambda t: min(t[1], t[2]))
    if rank > min(i, o):
        raise rank_refusal(rank, name, i, o)


def rank_refusal(rank: int, name: str, i: int, o: int) -> ValueError:
    """A rank above a targeted layer's smaller side gives adapters larger than a full-rank update of
    that layer: the refusal, with the largest rank that makes sense."""
    return ValueError(f"lora {rank} (--lora): LoRA rank {rank} is more than the smaller side of the adapted layer "
                      f"{name} ({i} in, {o} out): its adapters would hold more than the layer's own full-rank "
                      f"update; use a rank of at most {min(i, o)} (ranks of 4 to 64 are usual)")


def adapter_params(config_or_name: Any, rank: int = 8, targets: Sequence[str] = DEFAULT_TARGETS) -> int:
    """Trainable parameters LoRA adds: ``gpulab.formulas.lora_params(in, out, rank)`` summed over
    the targeted Linear layers."""
    check_rank(rank)
    return F.lora_trainable_params([(i, o) for _, i, o in targeted_linears(config_or_name, targets)], rank)



def import_peft():
    """``peft``. Where bitsandbytes is installed, peft imports it, and on a CPU with AVX512-BF16
    bitsandbytes logs at import that an optional kernel package (``kernels``) is missing: a note
    about bitsandbytes' own CPU kernels, not about the model, so its logger is quieted for the
    import (and restored)."""
    from gpulab.models.lean_imports import lean_peft   # the CLI's process: without bitsandbytes and torchao
    quiet = logging.getLogger("bitsandbytes")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with lean_peft():
            import peft
    finally:
        quiet.setLevel(level)
    return peft


def wrap_lora(base: nn.Module, rank: int, targets: Sequence[str], alpha: int | None = None,
              task_type: str | None = None, dropout: float = 0.0,
              adapter_dtype: torch.dtype | None = None) -> nn.Module:
    """``base`` wrapped by ``peft.get_peft_model`` with rank-``rank`` adapters on ``targets``
    (``lora_alpha`` ``alpha``, 2·rank when None; peft's ``task_type``, e.g. "CAUSAL_LM"; ``lora_dropout``
    ``dropout``, which peft applies to each adapted layer's input, its mask and output saved for backward;
    ``fan_in_fan_out`` for GPT-2's
    ``Conv1D``, which stores its weight (in, out)): the base frozen, the adapters trainable. peft's
    FutureWarning about transformers' renamed ``is_gradient_checkpointing`` is silenced (peft's
    code, not the caller's). ``adapter_dtype`` None: peft's default, fp16/bf16 adapters upcast to
    float32 (``autocast_adapter_dtype=True``); a dtype: ``autocast_adapter_dtype=False`` and the
    adapters in that dtype (peft gives them a float base layer's dtype; a quantized base's
    weight is uint8, so they are cast here). A layer list that names no linear layer raises
    ``ValueError``."""
    peft = import_peft()
    from transformers.pytorch_utils import Conv1D
    targets = check_targets(targets)
    if not any(is_target(n, targets) and linear_shape(m) is not None for n, m in base.named_modules()):
        raise ValueError(f"no linear layer of {type(base).__name__} is named {', '.join(targets)}: name the "
                         f"layers to adapt as the model calls them (e.g. q_proj v_proj for Llama, c_attn for GPT-2)")
    conv1d = any(isinstance(m, Conv1D) and is_target(n, targets) for n, m in base.named_modules())
    lora = peft.LoraConfig(r=check_rank(rank), lora_alpha=2 * rank if alpha is None else alpha,
                           target_modules=list(targets), lora_dropout=dropout, fan_in_fan_out=conv1d,
                           task_type=task_type)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = peft.get_peft_model(base, lora, autocast_adapter_dtype=adapter_dtype is None)
    if adapter_dtype is not None:
        for module in model.modules():
            if isinstance(module, peft.tuners.lora.LoraLayer):
                for name in module.adapter_layer_names:
                    getattr(module, name).to(adapter_dtype)
    return model
