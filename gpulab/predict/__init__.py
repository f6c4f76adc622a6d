"""Will it fit? Predictions of a step's memory, and answers built on them.

* ``breakdown``: a model layer by layer from shapes alone (meta device), and the formulas' view of
  a training step by category;
* ``step``: ``gpulab.step``: any model's training step tracked on an engine, beside the formulas;
* ``fit``: ``gpulab.fit``: the largest batch that fits a card (fake runs, the allocator
  simulator, levers); ``search`` (gallop and bisect), ``cards`` (the GPU table), ``guard``
  (refuse a real run that would not fit);
* ``replay``: tracked timelines of lesson 09's workloads replayed through the allocator
  simulator, beside the real allocator's counters.
"""
__all__: list[str] = []
