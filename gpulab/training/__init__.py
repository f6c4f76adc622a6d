"""How does a tracked training step run?

* ``loop``: the one training loop every step of the library runs (a workload, batches, an
  optimizer, autocast), marking each step on the tracker's timeline;
* ``optimizers``: the optimizers by name: the one list, the one check, the one builder.
"""
__all__: list[str] = []
