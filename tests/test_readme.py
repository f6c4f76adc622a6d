"""Every ```python block of README.md runs as written.

Each block runs as a script of its own (``python block.py``, as a reader would save it), in a
fresh temporary folder, with the repository on ``PYTHONPATH`` and a time limit. What the README
leaves to its reader is supplied here, and only that (``READER_SUPPLIES``): the two files it names as placeholders are made in the
folder first, and a block that uses ``MyNet`` without defining it (the README defines it once, in
an earlier block) gets a small module of that name. Nothing else is added: a block that forgets an
import, or calls an API by a name that no longer exists, fails here.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

README = ROOT / "README.md"
BLOCK_TIMEOUT_S = 240   # the distributed block starts two worker processes (about 30 s on 2 cores)

# A real message, as torch 2.15 raises it (PyTorch's format: c10/cuda/CUDACachingAllocator.cpp, see
# tests/test_oom_message.py), with the exception's name in front as a traceback's last line shows it.
OOM_TEXT = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
    "15.00 GiB of which 123.50 MiB is free. Including non-PyTorch memory, this process has 14.25 GiB memory in "
    "use. Of the allocated memory 12.25 GiB is allocated by PyTorch, and 1.50 GiB is reserved by PyTorch but "
    "unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
    "Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-"
    "alloc-conf)\n")

# MyNet as the README's first block defines it: only its name is visible to the block.
MYNET = '''
def _define_mynet():
    from torch import nn

    class MyNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10))

        def forward(self, x):
            return self.body(x)
    return MyNet


MyNet = _define_mynet()
del _define_mynet
'''


def _snapshot(path):
    # a PyTorch memory snapshot (the pickle torch.cuda.memory._snapshot() writes): the one the
    # tests read back, exported by gpulab (tests/data/README.md); no GPU here to record one
    shutil.copyfile(ROOT / "tests" / "data" / "snapshot_cnn_fake_step.pickle", path)


def _oom(path):
    path.write_text(OOM_TEXT)


READER_SUPPLIES = {
    "files": {"recorded_on_a_gpu.pickle": _snapshot, "oom.txt": _oom},
    "names": {"MyNet": MYNET},
}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```\s*$", text, re.S | re.M)


BLOCKS = python_blocks(README.read_text())


def test_readme_has_the_blocks_this_test_reads():
    assert len(BLOCKS) >= 3
    assert all(any(f'"{name}"' in b for b in BLOCKS) for name in READER_SUPPLIES["files"]), \
        "a placeholder file this test makes is no longer in README.md: update READER_SUPPLIES"


def _defines(block: str, name: str) -> bool:
    return re.search(rf"^\s*(class|def)\s+{name}\b|^\s*{name}\s*=", block, re.M) is not None


def _script(block: str) -> str:
    used = [name for name in READER_SUPPLIES["names"]
            if re.search(rf"\b{name}\b", block) and not _defines(block, name)]
    return "".join(READER_SUPPLIES["names"][n] for n in used) + "\n" + block


@pytest.mark.slow
@pytest.mark.timeout(BLOCK_TIMEOUT_S + 60)
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"block{i + 1}" for i in range(len(BLOCKS))])
def test_readme_block_runs(index, tmp_path):
    block = BLOCKS[index]
    for name, make in READER_SUPPLIES["files"].items():
        if name in block:
            make(tmp_path / name)
    script = tmp_path / f"readme_block{index + 1}.py"
    script.write_text(_script(block))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    try:
        done = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"README block {index + 1} ran past {BLOCK_TIMEOUT_S} s:\n{block}\n{exc.stderr or ''}")
    assert done.returncode == 0, f"README block {index + 1} failed:\n{block}\n--- stderr ---\n{done.stderr[-3000:]}"
