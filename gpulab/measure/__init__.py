"""How much memory does this code use, measured?

* ``tracking``: ``MemoryTracker``, live-tensor accounting by category (a dispatch mode) and its
  timeline and peak;
* ``engines``: ``run(experiment, engine)`` on the cuda, cpu or fake engine, the automatic choice
  and every result's label;
* ``fake_mode``, ``fake_kernels``, ``fake_internals``, ``fake_cuda``: the fake engine's fake tensors, answered
  fast and following CUDA's kernel choices; ``shape_kernels``: forwards on meta tensors, faster;
* ``gpu``: the machine's GPUs (NVML, ``torch.cuda``), safe without one;
* ``linetrack``: memory line by line (``%%memtrack``);
* ``real_timeline``: the real allocator's counters after every op of a CUDA run.
"""
__all__: list[str] = []
