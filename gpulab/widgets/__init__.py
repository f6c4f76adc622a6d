"""Widget panels, one module per panel, all built on ``gpulab.widgets.base.Panel``."""
from gpulab.widgets.base import GuardVerdict, Panel
from gpulab.widgets.step import step_panel

__all__ = ["GuardVerdict", "Panel", "step_panel"]
from gpulab.widgets.allocator import allocator_panel  # noqa: E402  (lesson 09)
__all__ += ["allocator_panel"]
from gpulab.widgets.env import engine_panel  # noqa: E402  (lesson 00)
from gpulab.widgets.tensor_bytes import rounding_panel, tensor_bytes_panel  # noqa: E402  (lesson 01)
__all__ += ["engine_panel", "rounding_panel", "tensor_bytes_panel"]
from gpulab.widgets.sweep import sweep_panel  # noqa: E402  (lesson 04)
from gpulab.widgets.largest_batch import largest_batch_panel  # noqa: E402  (lesson 04)
from gpulab.widgets.optimizers import optimizer_panel  # noqa: E402  (lesson 05)
from gpulab.widgets.optimizer_impl import implementation_panel  # noqa: E402  (lesson 05)
__all__ += ["implementation_panel", "largest_batch_panel", "optimizer_panel", "sweep_panel"]
from gpulab.widgets.parameters import layer_panel, parameters_panel  # noqa: E402  (lesson 02)
from gpulab.widgets.activations import forward_table_panel, inference_panel, modelsize_panel  # noqa: E402  (lesson 03)
from gpulab.widgets.flops import depthwise_panel, flops_panel  # noqa: E402  (lesson 03)
__all__ += ["depthwise_panel", "flops_panel", "forward_table_panel", "inference_panel", "layer_panel",
            "modelsize_panel", "parameters_panel"]
from gpulab.widgets.inplace import inplace_panel  # noqa: E402  (lesson 06)
from gpulab.widgets.inference_modes import grad_modes_panel  # noqa: E402  (lesson 06)
from gpulab.widgets.lifetimes import lifetimes_panel  # noqa: E402  (lesson 06)
from gpulab.widgets.checkpoint import checkpoint_panel  # noqa: E402  (lesson 07)
from gpulab.widgets.precision import precision_panel  # noqa: E402  (lesson 08)
__all__ += ["checkpoint_panel", "grad_modes_panel", "inplace_panel", "lifetimes_panel", "precision_panel"]
from gpulab.widgets.finetune import finetune_panel  # noqa: E402  (lesson 11)
__all__ += ["finetune_panel"]
from gpulab.widgets.transformers import activation_seq_panel, serving_panel  # noqa: E402  (lesson 11)
__all__ += ["activation_seq_panel", "serving_panel"]
from gpulab.widgets.distributed import sharding_panel  # noqa: E402  (lesson 12)
__all__ += ["sharding_panel"]
from gpulab.widgets.oom import oom_panel  # noqa: E402  (lesson 13)
__all__ += ["oom_panel"]
from gpulab.widgets.whatif import whatif_panel  # noqa: E402  (lesson 11)
__all__ += ["whatif_panel"]
