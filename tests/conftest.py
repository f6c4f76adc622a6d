import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
LESSONS = ROOT / "lessons"

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _agg_backend(monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")


def notebook_errors(nb) -> list[str]:
    """Every sign of failure in an executed notebook: error outputs, tracebacks on stderr,
    and panels that showed an error (in a cell's output or in the stored widget state,
    where Output widgets keep their contents)."""
    import json

    errors = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                errors.append(f"cell {i}: {out.get('ename')}: {out.get('evalue')}")
            if out.get("output_type") == "stream" and out.get("name") == "stderr" and "Traceback" in out.get("text", ""):
                errors.append(f"cell {i}: traceback on stderr")
            data = json.dumps(out.get("data", {}))
            if "gpulab-error" in data:
                j = data.index("gpulab-error")
                errors.append(f"cell {i}: a panel showed an error: {data[j:j + 300]}")
    state = json.dumps(nb.metadata.get("widgets", {}))
    if "gpulab-error" in state:
        j = state.index("gpulab-error")
        errors.append(f"a panel showed an error (widget state): {state[j:j + 300]}")
    return errors
