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
    # eager loads every kernel lazy loading does and more: the largest measurement of either (the H200's lazy one)
    assert eager.nbytes == max(m.nbytes for m in CONTEXT_MEASUREMENTS) >= lazy.nbytes
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
    assert s["context_label"].startswith("measured: 1,383.88 MiB on an NVIDIA H200")   # ours first
    assert s["context_warning"] is None
    assert cli.main(["fit", "mlp", "--gpu", "T4", "--cuda-module-loading", "eager"]) == 0
    assert "warning: eager module loading" in capsys.readouterr().out


def test_the_assumed_context_is_gpulabs_h200_measurement():
    """The lazy assumption is gpulab's own H200 figure (docs/gpu-validation-h200.md, CUDA context: NVML used −
    memory_reserved after the training steps, 1,383.88 MiB; 1,141.88 MiB right after start), labelled with
    its GPU and software."""
    ours = [m for m in CONTEXT_MEASUREMENTS if m.gpu == "NVIDIA H200"]
    assert [m.nbytes for m in ours] == [1_451_098_112, 1_197_342_720] == [CUDA_CONTEXT_ASSUMED, 1_197_342_720]
    label = context_assumption("lazy").label
    for text in ("1,383.88 MiB on an NVIDIA H200", "torch 2.11.0+cu130", "CUDA runtime 13.0", "driver 580.159.04",
                 "1,141.88 MiB right after start", "lazy module loading"):
        assert text in label, text
    assert "above the published" not in label
    # the H100's (docs/gpu-validation.md, 2026-11-27) is named too, and is below the assumption
    h100 = [m for m in CONTEXT_MEASUREMENTS if m.gpu.startswith("NVIDIA H100")]
    assert [m.nbytes for m in h100] == [1_347_223_552, 1_055_719_424] and h100[0].nbytes < CUDA_CONTEXT_ASSUMED
    assert "also measured: 1,284.81 MiB on an NVIDIA H100 80GB HBM3 after training steps, 1,006.81 MiB right " \
           "after start" in label and label.index("also measured") < label.index("published")
