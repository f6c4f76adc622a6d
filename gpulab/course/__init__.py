"""The course: one module per lesson or topic (its experiments, claims, exercises and figures),
built on the measurement library in ``gpulab``. Imports run one way: course -> library."""

__all__: list[str] = []
