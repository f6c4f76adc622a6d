"""The CUDA context's assumed size (``gpulab.predict.context``): each assumption rests on the
published measurements it names, fit and serve carry it with its label, eager loading warns."""
from __future__ import annotations

import pytest

import gpulab
from gpulab import cli
from gpulab.predict.cards import CUDA_CONTEXT_ASSUMED
from gpulab.predict.context import CONTEXT_MEASUREMENTS, context_assumption, context_label
from gpulab.predict.serve import serve


def test_each_assumption_covers_the_measurements_of_its_module_loading():
    lazy, eager = context_assumption("lazy"), context_assumption("eager")
    assert lazy.nbytes == CUDA_CONTEXT_ASSUMED and lazy.warning is None
    assert all(m.nbytes <= lazy.nbytes for m in CONTEXT_MEASUREMENTS if m.loading == "lazy")
    assert eager.nbytes == max(m.nbytes for m in CONTEXT_MEASUREMENTS if m.loading == "eager") > lazy.nbytes
    assert eager.warning and "CUDA_MODULE_LOADING" in eager.warning
    for m in CONTEXT_MEASUREMENTS:   # every figure the labels cite is in them
        assert m.source in (lazy.label if m.loading == "lazy" else eager.label)
    assert context_label(123 * 2 ** 20).startswith("given")
    with pytest.raises(ValueError, match="lazy"):
        context_assumption("sometimes")


def test_fit_and_serve_carry_the_assumption_and_its_warning(capsys):
    f = gpulab.fit("mlp", "T4", module_loading="eager").as_dict()
    assert f["context_bytes"] == context_assumption("eager").nbytes and f["context_warning"]
    s = serve("tiny-llama", "T4", context_len=32).as_dict()
    assert s["context_bytes"] == CUDA_CONTEXT_ASSUMED and "pytorch/pytorch#86509" in s["context_label"]
    assert s["context_warning"] is None
    assert cli.main(["fit", "mlp", "--gpu", "T4", "--cuda-module-loading", "eager"]) == 0
    assert "warning: eager module loading" in capsys.readouterr().out
