"""Which model, and what is one batch of its inputs?

* ``registry``: image models by name (the lesson models and every torchvision classifier),
  ``ModelSpec``, building in place or as a skeleton on meta;
* ``hf_configs``: the built-in transformer configs (GPT-2, Llama, Mistral, Qwen2 …), each with
  its source and published parameter count, built offline with random weights;
* ``workload``: any model as a workload (a name, ``hf:NAME``, a config, your ``nn.Module`` or a
  builder): build it, make one batch, compute its loss.
"""
__all__: list[str] = []
