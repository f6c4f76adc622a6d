"""PyTorch's own formats, read and written.

* ``snapshot``: a tracked timeline (or any alloc/free events) written as a
  ``torch.cuda.memory._snapshot()`` pickle, for ``pytorch.org/memory_viz``;
* ``snapshot_import``: such pickles read back (plain data only) and replayed segment by segment;
* ``snapshot_viewer``: what PyTorch's memory viewer shows of a snapshot, followed in Python;
* ``oom_message``: a CUDA out-of-memory message read: every figure, the case, the situation
  rebuilt in the simulator.
"""
__all__: list[str] = []
