"""The model registry: a name is resolved once, at the edge, and the spec travels down."""
import pytest

import gpulab.models.registry as M
from gpulab.predict.breakdown import breakdown
from gpulab.predict.step import step as tracked_step


class CountingRegistry(dict):
    """The registry, counting look-ups by name."""
    lookups = 0

    def __getitem__(self, key):
        type(self).lookups += 1
        return super().__getitem__(key)


@pytest.fixture
def counting(monkeypatch):
    reg = CountingRegistry(M.MODELS)
    CountingRegistry.lookups = 0
    monkeypatch.setattr(M, "MODELS", reg)
    M._meta_forward_ok.cache_clear()  # so the image-size checks run (and would re-resolve if they could)
    return CountingRegistry


@pytest.mark.parametrize("call", [
    lambda: tracked_step("cnn", batch=2, optimizer="sgd", engine="fake", steps=1, guard=False),
    lambda: tracked_step("resnet18", batch=1, image_size=64, optimizer="sgd", engine="fake", steps=1, guard=False),
    lambda: breakdown("vgg16"),
])
def test_one_registry_lookup_per_call(counting, call):
    call()
    assert counting.lookups == 1


def test_course_experiments_resolve_once(counting):
    from gpulab.course.optimizers import optimizer_run
    from gpulab.course.sweeps import batch_sweep
    optimizer_run("mlp", "adam", batch=2, engine="fake")
    assert counting.lookups == 1
    batch_sweep("cnn", (2, 4), engine="fake")
    assert counting.lookups == 2


def test_a_spec_passes_through_and_build_model_wants_one():
    spec = M.resolve_model("MLP")
    assert M.resolve_model(spec) is spec and spec.name == "mlp"
    with pytest.raises(TypeError, match="resolve_model"):
        M.build_model("mlp")


def test_unknown_name_lists_close_matches():
    with pytest.raises(ValueError, match=r"did you mean resnet18.*valid models: vgg16"):
        M.resolve_model("resnet19")
    with pytest.raises(ValueError) as e:
        M.resolve_model("zzz")
    assert "did you mean" not in str(e.value) and "valid models" in str(e.value)


def test_training_needs_more_than_one_value_per_channel():
    spec = M.resolve_model("resnet18")
    M.check_image_size(spec, 16)            # inference at 16 px works ...
    M.check_image_size(spec, 16, batch=2)   # ... and training at batch 2
    with pytest.raises(ValueError, match="too small for training resnet18 at batch 1.*image size of 33"):
        M.check_image_size(spec, 16, batch=1)
    M.check_image_size(spec, 33, batch=1)   # the size the message names does work
    with pytest.raises(ValueError, match="--image-size 33"):
        tracked_step("resnet18", batch=1, image_size=16, optimizer="sgd", engine="fake", steps=1, guard=False)
