"""The CLI contract: ``gpulab env | breakdown MODEL | step MODEL --json`` print exactly one JSON
object with the documented fields; bad input exits 2 with one line on stderr naming what is
valid, never a traceback.

Each JSON command (env, breakdown, step) runs once as a real subprocess (``python -m gpulab
...``); each imports torch, seconds on a shared 2-core CPU, so the few subprocesses are started
together once per module. The variations (other optimizers, bad input) call
``gpulab.cli.main(argv)`` in this process: the same parsing, experiment and JSON/err printing,
without the import cost. One bad-input case also runs as a subprocess, for the real exit code.
"""
import json
import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from gpulab import cli

from conftest import run_main

# one worker runs this module: its module-scoped fixture (a minute of stand-in or CLI runs) is built once
pytestmark = pytest.mark.xdist_group("cli")

ROOT = Path(__file__).resolve().parents[1]
CATS = {"parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries", "inputs"}
MLP_PARAMS = 3 * 32 * 32 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10   # 1,707,274
MLP_TENSORS = 6

COMMANDS = {
    "env": ["env", "--json"],
    "breakdown": ["breakdown", "vgg16", "--json"],
    "step": ["step", "mlp", "--engine", "cpu", "--batch", "2", "--optimizer", "adam", "--json"],
    "bad_model": ["step", "resnet9000", "--json"],
}


def test_output_into_a_closed_pipe_is_not_a_traceback():
    """``gpulab breakdown vgg16 | head -1``: the reader closes the pipe before gpulab writes
    (here at once, while gpulab still imports torch), so the write fails with EPIPE."""
    gl = subprocess.Popen([sys.executable, "-m", "gpulab", "breakdown", "vgg16", "--batch", "1"],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    gl.stdout.close()  # what head does after its lines
    _, err = gl.communicate(timeout=300)
    assert "Traceback" not in err.decode() and "BrokenPipeError" not in err.decode(), err.decode()
    assert gl.returncode in (0, 1)


def _gpulab(args):
    return subprocess.run([sys.executable, "-m", "gpulab", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def procs():
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {k: pool.submit(_gpulab, v) for k, v in COMMANDS.items()}
        return {k: f.result() for k, f in futures.items()}


def one_json(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    text = proc.stdout.strip()
    obj, end = json.JSONDecoder().raw_decode(text)
    assert end == len(text), "stdout holds more than one JSON object"
    assert isinstance(obj, dict)
    return obj


# --- env -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_env_json(procs):
    import torchvision

    d = one_json(procs["env"])
    assert d["python"] == platform.python_version()
    assert d["torch"] == torch.__version__
    assert d["torchvision"] == torchvision.__version__
    assert d["cuda_available"] is torch.cuda.is_available()
    assert d["engine"] == ("cuda" if torch.cuda.is_available() else "cpu")
    dev = d["device"]
    assert dev["cuda_available"] is torch.cuda.is_available()
    assert isinstance(dev["reason"], str) and isinstance(dev["gpus"], list)
    if torch.cuda.is_available():
        assert len(dev["gpus"]) == torch.cuda.device_count()
        g = dev["gpus"][0]
        assert g["name"] == torch.cuda.get_device_name(0)
        assert g["total_bytes"] == torch.cuda.mem_get_info(0)[1]
        assert 0 < g["used_bytes"] <= g["total_bytes"]
        assert g["compute_capability"] == "%d.%d" % torch.cuda.get_device_capability(0)
    else:
        assert dev["gpus"] == [] and "no CUDA GPU" in dev["reason"]
        assert d["engines"]["cuda"]["available"] is False


# --- breakdown ------------------------------------------------------------------------------

@pytest.mark.slow
def test_breakdown_json(procs):
    d = one_json(procs["breakdown"])
    assert d["model"] == "vgg16"
    assert d["input_shape"] == [1, 3, 224, 224]
    assert d["dtype"] == "float32"
    assert d["total_params"] == 138_357_544
    assert d["param_bytes"] == 4 * 138_357_544
    assert d["forward_flops"] == 30_940_528_640       # FlopCounterMode's count (test_formulas)
    layers = d["layers"]
    fields = {"name", "type", "output_shape", "params", "param_bytes", "output_bytes", "flops"}
    assert all(fields <= set(r) for r in layers)
    assert d["total_output_bytes"] == sum(r["output_bytes"] for r in layers)
    assert sum(r["params"] for r in layers) == d["total_params"]
    assert sum(r["flops"] for r in layers) == d["forward_flops"]
    first = layers[0]
    assert (first["name"], first["type"], first["output_shape"]) == ("features.0", "Conv2d", [1, 64, 224, 224])
    assert (first["params"], first["param_bytes"]) == (3 * 3 * 3 * 64 + 64, 4 * 1792)
    assert first["output_bytes"] == 64 * 224 * 224 * 4
    assert first["flops"] == 2 * 64 * 224 * 224 * 3 * 3 * 3
    assert layers[-1]["output_shape"] == [1, 1000] and layers[-1]["type"] == "Linear"
    for r in layers:
        shape = r["output_shape"]
        n = 1
        for s in shape:
            n *= s
        assert r["output_bytes"] == 4 * n


# --- step -----------------------------------------------------------------------------------

def check_step_fields(d: dict) -> None:
    assert (d["model"], d["batch"], d["image_size"]) == ("mlp", 2, 32)
    assert (d["engine"], d["device"]) == ("cpu", "cpu")
    assert d["label"] == "measured on CPU (live tensors)"
    assert isinstance(d["peak_bytes"], int) and d["peak_bytes"] > 0
    assert set(d["peak_by_category"]) == CATS
    assert sum(d["peak_by_category"].values()) == d["peak_bytes"]
    assert set(d["predicted"]) == CATS
    assert d["predicted"]["temporaries"] is None
    assert d["predicted"]["inputs"] == 2 * 3 * 32 * 32 * 4 + 2 * 8
    assert d["oom"] is False and d["error"] is None


@pytest.mark.slow
def test_step_json_fields(procs):
    d = one_json(procs["step"])
    check_step_fields(d)
    assert (d["optimizer"], d["steps"]) == ("adam", 2)   # steady state by default: two steps
    assert len(d["step_peaks"]) == 2 and d["steady_peak_bytes"] == d["step_peaks"][1]
    after = d["after_step_by_category"]
    assert after["optimizer_state"] == 2 * after["parameters"] + 4 * MLP_TENSORS


@pytest.mark.parametrize("optimizer,steps,mult,step_counters", [
    ("sgd", 1, 0, False), ("momentum", 1, 1, False), ("momentum", 2, 1, False),
    ("adam", 1, 2, True), ("adamw", 2, 2, True),
])
def test_step_optimizer_state_is_multiple_of_params(optimizer, steps, mult, step_counters, capsys):
    code, out, err = run_main(["step", "mlp", "--engine", "cpu", "--batch", "2", "--optimizer", optimizer,
                               "--steps", str(steps), "--json"], capsys)
    assert code == 0 and err == ""
    d = json.loads(out)
    check_step_fields(d)
    after = d["after_step_by_category"]
    params = after["parameters"]
    assert params == 4 * MLP_PARAMS
    assert after["gradients"] == params
    extra = 4 * MLP_TENSORS if step_counters else 0
    assert after["optimizer_state"] == mult * params + extra
    assert d["predicted"]["optimizer_state"] == mult * params + extra
    assert d["predicted"]["parameters"] == d["predicted"]["gradients"] == params
    # with two steps the state exists when the second step peaks
    if d["steps"] == 2:
        assert d["peak_by_category"]["optimizer_state"] == mult * params + extra


# --- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("argv,expect", [
    (["step", "resnet9000", "--json"], ["unknown model", "vgg16", "alexnet", "resnet18", "mlp", "cnn"]),
    (["breakdown", "lenet"], ["unknown model", "vgg16"]),
    (["step", "mlp", "--batch", "0", "--json"], ["--batch", "positive integer"]),
    (["step", "mlp", "--batch", "-3"], ["--batch", "positive integer"]),
    (["breakdown", "mlp", "--batch", "two"], ["--batch", "positive integer"]),
    (["step", "mlp", "--steps", "0"], ["--steps", "positive integer"]),
    (["breakdown", "vgg16", "--dtype", "fp17"], ["unknown dtype", "valid dtypes", "float32", "bf16"]),
    (["step", "mlp", "--dtype", "int8"], ["float32", "bfloat16", "float16"]),
    (["breakdown", "vgg16", "--dtype", "float8_e4m3fn"], ["float32", "bfloat16"]),
    (["breakdown", "alexnet", "--image-size", "32"], ["too small for alexnet", "--image-size 63"]),
    (["step", "vgg16", "--image-size", "16", "--engine", "fake"], ["too small for vgg16", "--image-size 32"]),
    # passes inference at 16 px but not training at batch 1: batch norm sees one value per channel
    (["step", "resnet18", "--image-size", "16", "--batch", "1", "--engine", "fake"],
     ["too small for training resnet18 at batch 1", "batch norm", "--image-size 33", "larger batch"]),
    (["step", "resnet19"], ["unknown model", "did you mean resnet18"]),
    (["step", "mlp", "--engine", "tpu"], ["unknown engine", "auto", "cuda", "cpu", "fake"]),
    (["step", "mlp", "--optimizer", "lion"], ["--optimizer", "sgd", "momentum", "adam", "adamw"]),
    (["launch"], ["invalid choice", "env", "breakdown", "step"]),
    (["step", "mlp", "--steps", "50"], ["--steps", "at most 10", "steady state"]),
    (["step", "mlp", "--engine", "fake", "--batch", str(10 ** 30)], ["cannot be made", "smaller --batch"]),
    (["step", "mlp", "--engine", "fake", "--image-size", str(10 ** 11)], ["cannot be made", "--image-size"]),
])
def test_bad_input_exits_2_with_one_line(argv, expect, capsys):
    code, out, err = run_main(argv, capsys)
    assert code == 2
    assert out == _json_error_or_nothing(argv, err)
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("gpulab: error: ")
    assert "Traceback" not in err
    for word in expect:
        assert word in err


def _json_error_or_nothing(argv, err: str) -> str:
    """What stdout holds after a refusal: nothing, or under --json the stderr line's message as one
    JSON object (issue 44 item 6: a script reads the error from stdout)."""
    return json.dumps({"error": err.strip().removeprefix("gpulab: error: ")}) + "\n" if "--json" in argv else ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the cuda engine is available here")
def test_engine_cuda_without_gpu(capsys):
    argv = ["step", "mlp", "--engine", "cuda", "--json"]
    code, out, err = run_main(argv, capsys)
    assert code == 2 and out == _json_error_or_nothing(argv, err) and err.count("\n") == 1
    assert "engine 'cuda' is not available" in err and err.strip().endswith("available: auto, cpu, fake")


@pytest.mark.slow
def test_bad_input_in_a_real_process(procs):
    p = procs["bad_model"]
    assert p.returncode == 2
    assert p.stdout == _json_error_or_nothing(["--json"], p.stderr)   # --json: the error as one JSON object
    assert p.stderr.count("\n") == 1 and "unknown model 'resnet9000'" in p.stderr
    assert "Traceback" not in p.stderr


def test_an_interrupt_is_one_line_and_exit_130(capsys, monkeypatch):
    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "env_info", interrupted)
    code, out, err = run_main(["env"], capsys)
    assert code == 130 and out == "" and err == "gpulab: interrupted\n"


def test_an_internal_error_says_so_in_one_line_and_debug_shows_it(capsys, monkeypatch):
    def broken():
        return {}["no such key"]
    monkeypatch.setattr(cli, "env_info", broken)
    code, out, err = run_main(["env"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("gpulab: internal error: KeyError") and "report it" in err and "--debug" in err
    with pytest.raises(KeyError):
        cli.main(["env", "--debug"])
