"""Every ```python block of README.md and docs/api.md runs as written.

Each block runs as a script of its own (``python block.py``, as a reader would save it), in a
fresh temporary folder, with the repository on ``PYTHONPATH`` and a time limit. What the README
leaves to its reader is supplied here, and only that (``READER_SUPPLIES``): the two files docs/api.md names as placeholders are made
in the folder first, and a block that uses ``MyNet`` without defining it (each file defines it once,
in an earlier block) gets a small module of that name. Nothing else is added: a block that forgets an
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
DOCS = (README, ROOT / "docs" / "api.md")   # the files whose python blocks a reader copies
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

# MyNet as the first block of README.md and docs/api.md defines it: only its name is visible to the block.
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


BLOCKS = [(path, i, block) for path in DOCS for i, block in enumerate(python_blocks(path.read_text()), 1)]


def test_readme_has_the_blocks_this_test_reads():
    assert any(path == README for path, _, _ in BLOCKS), "README.md has no python block left to run"
    assert len(BLOCKS) >= 3
    assert all(any(f'"{name}"' in b for _, _, b in BLOCKS) for name in READER_SUPPLIES["files"]), \
        "a placeholder file this test makes is no longer in README.md or docs/api.md: update READER_SUPPLIES"
    for name in READER_SUPPLIES["names"]:   # each file defines MyNet before a block uses it undefined
        for path in DOCS:
            blocks = python_blocks(path.read_text())
            users = [i for i, b in enumerate(blocks) if re.search(rf"\b{name}\b", b)]
            assert not users or _defines(blocks[users[0]], name), \
                f"{path.name}: its first block using {name} does not define it"


def _defines(block: str, name: str) -> bool:
    return re.search(rf"^\s*(class|def)\s+{name}\b|^\s*{name}\s*=", block, re.M) is not None


def _script(block: str) -> str:
    used = [name for name in READER_SUPPLIES["names"]
            if re.search(rf"\b{name}\b", block) and not _defines(block, name)]
    return "".join(READER_SUPPLIES["names"][n] for n in used) + "\n" + block


@pytest.mark.slow
@pytest.mark.timeout(BLOCK_TIMEOUT_S + 60)
@pytest.mark.parametrize("path,number,block", BLOCKS, ids=[f"{p.stem}-block{i}" for p, i, _ in BLOCKS])
def test_readme_block_runs(path, number, block, tmp_path):
    for name, make in READER_SUPPLIES["files"].items():
        if name in block:
            make(tmp_path / name)
    script = tmp_path / f"{path.stem}_block{number}.py"
    script.write_text(_script(block))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    try:
        done = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{path.name} block {number} ran past {BLOCK_TIMEOUT_S} s:\n{block}\n{exc.stderr or ''}")
    assert done.returncode == 0, f"{path.name} block {number} failed:\n{block}\n--- stderr ---\n{done.stderr[-3000:]}"
