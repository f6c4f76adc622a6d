"""Real GPU numbers for CPU-only students: ``gpulab record`` and its records.

* ``runner``: the record set (plain data), run on CUDA, with provenance; one JSON file per GPU;
* ``lookup``: records read back (a stand-in GPU's refused) and found by experiment and settings;
* ``views``: the "same settings on a real GPU" block every panel shows;
* ``runs/``: the lessons' measuring cores (one module per lesson subject), data only: what both
  the course and ``gpulab record`` run.
"""
__all__: list[str] = []
