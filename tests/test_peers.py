"""``benchmarks/peers.py``'s Megatron rows: megatron-core's theoretical memory and megatron-bridge's
``estimate_training_memory``, run from their installed source, against the formulas they implement
(Korthikanti et al. 2022, table 2, and Megatron's 18 bytes a parameter) worked out here from the
model's shape; and the term the benchmark names for PyTorch's tensor parallelism. gpulab's own row
is a minutes-long fake run: the benchmark prints it."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "peers.py"

# Llama 2 7B, TP 2 x PP 2 with sequence parallelism, 4 micro-batches of 1 x 4096 (the benchmark's setting)
H, FFN, V, L, S, TP, PP = 4096, 11008, 32000, 32, 4096, 2, 2


def _peers():
    spec = importlib.util.spec_from_file_location("peers", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _estimator(peers, which):
    try:
        peers.megatron_module(which)
    except ImportError as exc:
        pytest.skip(f"{exc.name} is not installed (it needs Python >= 3.12; pip install --no-deps "
                    f"megatron-core==0.19.2 megatron-bridge==0.6.2 where it is not)")
    return {"core": peers.megatron_core_memory, "bridge": peers.megatron_bridge_memory}[which]


def _rank_params():
    layer = 4 * H * H + 3 * H * FFN            # q, k, v, o (no GQA) and SwiGLU's three projections
    split = (L // PP * layer + H * V) / TP     # stage 0's layers and the input embedding, split by TP
    replicated = (L * 2 * H + H) / PP          # the RMSNorms, whole on every TP rank
    return split + replicated


@pytest.mark.parametrize("which", ["core", "bridge"])
def test_megatrons_estimators_run_here_and_compute_their_formulas(which):
    peers = _peers()
    estimate = _estimator(peers, which)
    kw = {"sequence_parallel": True} if which == "core" else {}
    est = estimate("llama-2-7b", seq=S, micro_batch=1, tp=TP, pp=PP, microbatches=4, **kw)
    assert est["weights and optimizer"] == pytest.approx(18 * _rank_params(), rel=1e-9)
    # table 2 with SP and selective recompute, the ffn term as 4 x ffn/h; stage 0 holds pp micro-batches
    # of its L/pp layers (L layers' worth), plus the embedding's input ids and dropout mask, all over TP
    act = (S * H * (18 + 4 * FFN / H) * L + 8 * S * PP + S * H * PP) / TP
    assert est["activations"] == pytest.approx(act, rel=1e-9)


def test_the_gathered_input_term_is_two_hidden_wide_inputs_a_layer_less_their_shard():
    peers = _peers()
    terms = dict((t.split(":")[0], b) for t, b in peers.megatron_terms("llama-2-7b", seq=S, micro_batch=1, tp=TP,
                                                                      pp=PP, microbatches=4))
    gathered = terms["each block's gathered input saved whole"]
    assert gathered == pytest.approx(L * 2 * S * H * 2 / 2)     # 32 layers' worth in flight, bf16, half missing
    swiglu = next(b for t, b in terms.items() if t.startswith("SwiGLU"))
    assert swiglu == pytest.approx(L * S * FFN * 2 * 2 / TP)
    # no TP, no gathered input
    assert not any("gathered" in t for t, _ in peers.megatron_terms("llama-2-7b", seq=S, micro_batch=1, tp=1,
                                                                      pp=PP, microbatches=4))
