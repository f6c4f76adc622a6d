import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
LESSONS = ROOT / "lessons"

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _agg_backend(monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
