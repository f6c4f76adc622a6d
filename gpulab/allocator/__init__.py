"""Where does PyTorch's CUDA caching allocator put a tensor, and what does it reserve?

* ``simulator``: the caching allocator re-built in Python, rule by rule from
  ``c10/cuda/CUDACachingAllocator.cpp`` (block sizes, pools, splitting, caching,
  ``empty_cache``, expandable segments), replayable from any list of allocations and frees;
* ``plots``: its figures (allocated vs reserved over time, the segment map).

Timelines to replay come from ``gpulab.measure`` (a tracked run), ``gpulab.predict.replay``
(lesson 09's workloads) and ``gpulab.interop`` (PyTorch memory snapshots).
"""
__all__: list[str] = []
