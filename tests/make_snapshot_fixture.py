"""Write tests/data/snapshot_cnn_fake_step.pickle, the small PyTorch memory snapshot the tests and
lesson 13 read back (see tests/data/README.md).

    .venv/bin/python tests/make_snapshot_fixture.py

It is made on the CPU by gpulab's export path (gpulab.course.pytorch_tools.make_example_snapshot:
one fake-engine training step of the small CNN, replayed through the simulated allocator), so it
is NOT a GPU recording; its "gpulab" entry says so. tests/test_snapshot.py reads the file back
(gpulab.interop.snapshot_import) and checks that a fresh one made the same way replays the same way; run
this script again when the export or the fake engine changes what it writes.
"""
from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpulab.course.pytorch_tools import EXAMPLE_SNAPSHOT, make_example_snapshot  # noqa: E402


def main() -> None:
    path = make_example_snapshot().save(EXAMPLE_SNAPSHOT, overwrite=True)
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
