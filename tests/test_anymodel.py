"""gpulab.step / gpulab.breakdown on any model: registered names, every torchvision model,
transformer configs, your nn.Module, a builder function; inputs and losses; bad input."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import gpulab
from gpulab.predict import guard as guard_module
from gpulab.models.registry import build_model, resolve_model, torchvision_names
from gpulab.models.workload import resolve_workload


class TwoLayer(nn.Module):
    def __init__(self, d_in: int = 100, hidden: int = 200, classes: int = 10):
        super().__init__()
        self.a = nn.Linear(d_in, hidden)
        self.b = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class NeedsTwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)

    def forward(self, x, scale):
        return self.a(x) * scale


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _tiny_llama_config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)


KINDS = {
    "lesson name": dict(model="mlp", batch=4),
    "torchvision name": dict(model="torchvision:squeezenet1_1", batch=2, image_size=64),
    "hf name": dict(model="hf:tiny-llama", batch=2, seq_len=16),
    "hf gpt2 name": dict(model="hf:tiny-gpt2", batch=2, seq_len=16),
    "config object": dict(model=_tiny_llama_config, batch=2, seq_len=16),   # called below: a fresh config
    "module instance": dict(model=TwoLayer, batch=8),                      # instantiated below
    "builder function": dict(model=lambda: TwoLayer(), batch=8),
}


def _kwargs(kind: str) -> dict:
    kw = dict(KINDS[kind])
    if kind in ("config object", "module instance"):
        kw["model"] = kw["model"]()
    return kw


@pytest.mark.parametrize("engine", ["cpu", "fake"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_model_kind_runs_two_steps_by_category(kind, engine):
    kw = _kwargs(kind)
    r = gpulab.step(kw.pop("model"), engine=engine, optimizer="adam", **kw)
    assert r.engine == engine and r.steps == 2 and len(r.step_peaks) == 2
    assert r.peak_bytes == max(r.step_peaks) and r.steady_peak_bytes == r.step_peaks[1]
    c = r.tensor_bytes_by_category
    assert c["parameters"] == r.predicted["parameters"] > 0        # exact: numel x element size
    assert r.predicted["optimizer_state"] > 0 and c["inputs"] > 0
    d = r.as_dict()
    assert d["first_step_peak_bytes"] == r.step_peaks[0] and d["input"] == r.input_text
    assert r._repr_html_().count("step 2") == 1 and "StepResult(" in repr(r)


def test_your_module_is_copied_never_trained():
    m = TwoLayer()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    r = gpulab.step(m, batch=8, engine="cpu", optimizer="adam")
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert all(p.grad is None for p in m.parameters())
    assert r.tensor_bytes_by_category["parameters"] == _param_bytes(m)
    assert "vectors (8, 100)" in r.input_text and "Linear" in r.input_text   # read off its first layer


def test_fake_cpu_target_equals_cpu_engine_for_your_module():
    m = TwoLayer()
    cpu = gpulab.step(m, batch=16, engine="cpu", optimizer="adam")
    fake = gpulab.step(m, batch=16, engine="fake", fake_target="cpu", optimizer="adam")
    assert fake.peak_bytes == cpu.peak_bytes and fake.step_peaks == cpu.step_peaks
    assert fake.peak_by_category == cpu.peak_by_category


class Encoder(nn.Module):
    """nn.TransformerEncoder deep-copies its layer: under fake tensors the copies must belong to
    the fake mode in force (registry._FakeDeepcopy), else the forward stops with 'Mixing fake modes'."""

    def __init__(self):
        super().__init__()
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 2)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.enc(x).mean(1))


def test_a_module_that_deep_copies_its_layers_runs_on_fake_tensors_as_on_the_cpu():
    x = torch.randn(1, 16, 64)
    cpu = gpulab.step(Encoder, x, batch=4, engine="cpu", optimizer="adam")
    fake = gpulab.step(Encoder, x, batch=4, engine="fake", fake_target="cpu", optimizer="adam")
    assert fake.step_peaks == cpu.step_peaks and fake.peak_by_category == cpu.peak_by_category
    # two copies of the layer, each its own parameters (33,472 values), and the head
    assert fake.tensor_bytes_by_category["parameters"] == (2 * 33_472 + 64 * 10 + 10) * 4


def test_fake_engine_builds_a_callable_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensor
    made = []

    def build():
        net = TwoLayer(4096, 4096, 10)
        made.append(all(isinstance(p, FakeTensor) or p.is_meta for p in net.parameters()))
        return net
    r = gpulab.step(build, batch=4, engine="fake")
    assert made and all(made)   # reading its input off it, the breakdown, the run: never a real storage
    assert r.tensor_bytes_by_category["parameters"] == (4096 * 4096 + 4096 + 4096 * 10 + 10) * 4


def test_inputs_as_templates_as_a_callable_and_as_a_shape():
    m = TwoLayer()
    a = gpulab.step(m, torch.randn(3, 100), batch=8, engine="cpu")
    b = gpulab.step(m, lambda n: torch.randn(n, 100), batch=8, engine="cpu")
    c = gpulab.step(m, input_shape=(100,), batch=8, engine="cpu")
    assert a.tensor_bytes_by_category["inputs"] == b.tensor_bytes_by_category["inputs"] == \
        c.tensor_bytes_by_category["inputs"] == 8 * 100 * 4
    two = gpulab.step(NeedsTwoInputs(), (torch.randn(2, 8), torch.ones(2, 1)), batch=5, engine="cpu")
    assert two.tensor_bytes_by_category["inputs"] == 5 * 8 * 4 + 5 * 4
    ids = gpulab.step("hf:tiny-llama", {"input_ids": torch.randint(0, 10, (1, 12))}, batch=3, engine="cpu",
                      loss=lambda out: out.logits.float().mean())
    assert ids.tensor_bytes_by_category["inputs"] == 3 * 12 * 8 and "input_ids=int64 (3, 12)" in ids.input_text


def test_custom_loss_and_tuple_outputs():
    r = gpulab.step(TwoLayer(), batch=4, engine="cpu", loss=lambda out: out.pow(2).mean())
    assert r.peak_bytes > 0
    g = gpulab.step("googlenet", batch=2, image_size=64, engine="fake")   # GoogLeNetOutputs in training
    assert g.peak_bytes > 0


def test_steady_state_holds_the_momentum_state():
    """Issue #12's example: VGG16 with momentum at batch 64. The first step's peak misses the
    momentum buffers (one per parameter) that every later step holds."""
    r = gpulab.step("vgg16", batch=64, optimizer="momentum", engine="fake")
    assert r.tensor_bytes_by_category["optimizer_state"] == r.predicted["optimizer_state"] > 500 * 2**20  # 527.8 MiB
    assert r.steady_peak_bytes - r.first_step_peak_bytes == r.peak_by_category["optimizer_state"]  # 512-B blocks


def test_breakdown_accepts_every_kind():
    assert gpulab.breakdown("resnet50").total_params == 25_557_032                  # torchvision's count
    assert gpulab.breakdown("hf:gpt2", seq_len=8).total_params == 124_439_808
    bd = gpulab.breakdown(TwoLayer(), batch=3)
    assert bd.total_params == 100 * 200 + 200 + 200 * 10 + 10 and bd.input_shape == [3, 100]


@pytest.mark.parametrize("name", ["hf:llama-3-8b", "hf:mistral-7b"])
def test_published_counts_through_the_workload(name):
    from gpulab.models.hf_configs import hf_entry
    w = resolve_workload(name)
    assert sum(p.numel() for p in w.build("meta", None).parameters()) == hf_entry(name).published_params


def test_every_torchvision_model_is_registered_and_counts_its_own_parameters():
    import torchvision.models as tvm
    names = torchvision_names()
    assert len(names) == len(tvm.list_models(module=tvm)) and "resnet50" in names
    for name in ("regnet_y_400mf", "vit_b_16", "efficientnet_b0", "inception_v3"):
        spec = resolve_model(f"torchvision:{name}")
        init = {"init_weights": True} if name == "inception_v3" else {}   # no FutureWarning about its default
        theirs = sum(p.numel() for p in tvm.get_model(name, weights=None, **init).parameters())   # real, on the CPU
        ours = sum(p.numel() for p in build_model(spec, device="meta").parameters())
        assert ours == theirs, name
    assert resolve_model("inception_v3").default_image_size == 299
    assert resolve_model("vit_h_14").default_image_size == 224    # built without weights: 224


def test_a_builder_that_computes_on_the_way_runs_on_fake_tensors():
    """RegNet turns a tensor of widths into a list while it builds (.tolist()): on the meta device
    and under fake tensors it is built as a skeleton, then given fake storages."""
    r = gpulab.step("regnet_x_400mf", batch=2, image_size=64, engine="fake")
    cpu = gpulab.step("regnet_x_400mf", batch=2, image_size=64, engine="cpu")
    assert r.tensor_bytes_by_category["parameters"] == cpu.tensor_bytes_by_category["parameters"]


@pytest.mark.parametrize("call, words", [
    (lambda: gpulab.step("resnet9000"), ["unknown model", "did you mean", "torchvision", "hf:gpt2"]),
    (lambda: gpulab.step("hf:llama3"), ["unknown transformer config", "llama-3-8b"]),
    (lambda: gpulab.step("hf:tiny-gpt2", seq_len=100000), ["longer than", "--seq-len 256"]),
    (lambda: gpulab.step(TwoLayer(), input_shape=(0,)), ["input_shape", "positive integers"]),
    (lambda: gpulab.step(TwoLayer(), loss="mse"), ["loss must be a callable"]),
    (lambda: gpulab.step(TwoLayer(), [1, 2]), ["inputs must be a tensor"]),
    (lambda: gpulab.step(42), ["cannot use int as a model"]),
    (lambda: gpulab.step(lambda: 5, batch=2), ["the builder <lambda>() must return an nn.Module", "returned int 5",
                                               "lambda: MyNet()"]),
    (lambda: gpulab.step(lambda: None, input_shape=(4,)), ["must return an nn.Module", "returned None"]),
    (lambda: gpulab.fit(lambda: "resnet50", "24GiB"), ["must return an nn.Module", "returned str 'resnet50'"]),
    (lambda: gpulab.step(nn.ReLU()), ["cannot tell what input", "input_shape"]),
    (lambda: gpulab.step(TwoLayer(), input_shape=(7,), engine="cpu"),
     ["failed on the meta device (shapes only)", "float tensor (1, 7)", "pass inputs="]),
    (lambda: gpulab.step(NeedsTwoInputs(), batch=2, engine="fake"), ["failed", "vectors (2, 8)", "missing 1",
                                                                     "inputs="]),
    (lambda: gpulab.step("mlp", optimizer="lion"), ["unknown optimizer", "adam"]),
    (lambda: gpulab.step("mlp", amp="fp8"), ["--amp", "fp16", "bf16"]),
])
def test_bad_input_says_what_to_do(call, words):
    with pytest.raises(ValueError) as info:
        call()
    text = str(info.value)
    assert all(w in text for w in words), text
    assert "\n" not in text


def test_the_guard_refuses_a_real_run_that_would_not_fit(monkeypatch):
    monkeypatch.setattr(guard_module, "free_memory", lambda engine: (1024, "test: 1 KiB"))
    with pytest.raises(ValueError, match=r"not run: the fake engine predicts a peak of .* more than the 1\.0 KiB"):
        gpulab.step("mlp", batch=4, engine="cpu")
    assert gpulab.step("mlp", batch=4, engine="fake").peak_bytes > 1024    # the fake engine is never refused
    assert gpulab.step("mlp", batch=4, engine="cpu", guard=False).peak_bytes > 0


def test_autocast_and_pure_bf16():
    amp = gpulab.step("hf:tiny-llama", batch=2, seq_len=16, engine="cpu", amp="bf16")
    pure = gpulab.step("hf:tiny-llama", batch=2, seq_len=16, engine="cpu", dtype="bf16")
    fp32 = gpulab.step("hf:tiny-llama", batch=2, seq_len=16, engine="cpu")
    assert amp.amp == "bf16" and pure.dtype == "bfloat16"
    assert pure.tensor_bytes_by_category["parameters"] * 2 == fp32.tensor_bytes_by_category["parameters"]
    assert amp.tensor_bytes_by_category["parameters"] == fp32.tensor_bytes_by_category["parameters"]


class _TiedGPT(nn.Module):
    """nanoGPT's shape in miniature: the LM head's weight is the token embedding's."""

    def __init__(self, vocab=512, d=64, n=2, ctx=64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.Sequential(*[nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
                                      for _ in range(n)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.wte(idx) + self.wpe(pos))))


def test_tied_weights_stay_tied_on_every_engine():
    """One parameter shared by the embedding and the LM head: one gradient, one set of Adam
    state, whether the model comes as an instance (copied onto fake tensors) or a builder, and
    the same bytes as real tensors on the CPU."""
    x = torch.randint(0, 512, (1, 64))
    runs = {"cpu": gpulab.step(_TiedGPT(), x, batch=2, engine="cpu"),
            "fake, instance": gpulab.step(_TiedGPT(), x, batch=2, engine="fake", fake_target="cpu"),
            "fake, builder": gpulab.step(lambda: _TiedGPT(), x, batch=2, engine="fake", fake_target="cpu")}
    peaks = {k: r.measurement.tracking.peak_by_category for k, r in runs.items()}
    n_params = sum(p.numel() for p in _TiedGPT().parameters())   # the tied weight counted once
    assert peaks["cpu"]["parameters"] == n_params * 4
    assert peaks["fake, instance"] == peaks["fake, builder"] == peaks["cpu"], peaks
    # Adam: two fp32 states per parameter (plus a step counter per tensor)
    assert 2 * n_params * 4 <= peaks["cpu"]["optimizer_state"] < 2 * n_params * 4 + 4096
    ctx = 512 * 2**20   # a toy card: the measured CUDA context (1.35 GiB) would not leave room on it
    a = gpulab.fit(_TiedGPT(), "600MiB", inputs=x, context_bytes=ctx)
    b = gpulab.fit(lambda: _TiedGPT(), "600MiB", inputs=x, context_bytes=ctx)
    assert a.largest_batch == b.largest_batch and a.peak_bytes == b.peak_bytes


class _Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        raise RuntimeError("my model's own bug")


def test_fit_wraps_a_models_own_error_like_step():
    for call in (lambda: gpulab.fit(_Boom(), "4GiB", inputs=torch.randn(1, 4)),
                 lambda: gpulab.step(_Boom(), torch.randn(1, 4), engine="fake")):
        with pytest.raises(ValueError) as e:
            call()
        msg = str(e.value)
        assert "my model's own bug" in msg and "with the input gpulab made" in msg and "pass inputs=" in msg


@pytest.mark.parametrize("kw", [{"batch": -3}, {"batch": 0}, {"steps": 0}, {"steps": 10 ** 9}, {"steps": True}])
def test_step_refuses_bad_counts_before_building_anything(kw):
    with pytest.raises(ValueError, match="batch size must be a positive integer|steps must be a whole number"):
        gpulab.step("mlp", engine="fake", **kw)


def test_the_input_description_names_the_batch_everywhere():
    """Every B of a workload's input text becomes the batch (the labels' shape too), and a step's
    record says the same."""
    w = resolve_workload("cnn")
    assert w.describe_input(8) == "images (8, 3, 32, 32) and int64 labels (8,)"
    assert "B" not in gpulab.step("mlp", batch=4, engine="fake").input_text.replace("bytes", "")
