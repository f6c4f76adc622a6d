"""PyTorch's own formats, read and written.

* ``snapshot``: a tracked timeline (or any alloc/free events) written as a
  ``torch.cuda.memory._snapshot()`` pickle, for ``pytorch.org/memory_viz``;
* ``snapshot_import``: such pickles read back (plain data only) and replayed segment by segment;
* ``snapshot_start``: a mid-run snapshot's start (the segments and blocks before its first trace
  entry) rebuilt from the file, for the replay to start from;
* ``recorded_snapshots``: snapshots recorded on a real GPU that ship with gpulab (``data/``), with
  their provenance, beside their replay;
* ``snapshot_viewer``: what PyTorch's memory viewer shows of a snapshot, followed in Python;
* ``oom_message``: a CUDA out-of-memory message read: every figure, the case, the situation
  rebuilt in the simulator.
"""
__all__: list[str] = []
