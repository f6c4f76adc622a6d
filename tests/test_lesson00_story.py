"""Lesson 00's story: a model that fits by parameter count, a training step that does not."""
import pytest

from gpulab.course import start as S
from gpulab.measure.engines import LABEL_FAKE_CUDA
from gpulab.units import GiB


@pytest.fixture(scope="module")
def story():
    return S.oom_story("vgg16", batch=128, optimizer="adam", card_gib=8)


def test_the_parameters_fit_but_the_step_does_not(story):
    assert story.n_params == 138_357_544            # torchvision VGG16
    assert story.param_bytes == 4 * 138_357_544     # formula
    assert story.adam_bytes < 8 * GiB < story.peak_bytes
    assert not story.fits and story.margin_bytes == 8 * GiB - story.peak_bytes < 0
    assert "does not fit" in story.verdict
    assert story.label == LABEL_FAKE_CUDA           # no GPU measured it, and it says whose kernels


def test_peak_by_category_adds_up_and_activations_dominate(story):
    pc = story.peak_by_category
    assert sum(pc.values()) == story.peak_bytes
    assert story.largest == "activations" and pc["activations"] > story.peak_bytes / 2
    assert pc["optimizer_state"] > 0                # the second step: Adam's state exists
    assert all(c in S.CATEGORY_LESSONS for c in pc)


def test_the_verdict_follows_the_card():
    small = S.oom_story("vgg16", batch=8, optimizer="sgd", card_gib=8)
    assert small.fits and "fits" in small.verdict and small.margin_bytes > 0
    with pytest.raises(ValueError):
        S.oom_story(card_gib=0)


def test_views_and_exercise(story):
    html = story._repr_html_()
    assert "07_checkpointing.ipynb" in html and "09_caching_allocator.ipynb" in html and "formula" in html
    assert LABEL_FAKE_CUDA.replace("'", "&#x27;") in html
    story.figure()
    ex = S.exercise_where_memory_went(story)
    assert ex.check("c").ok and not ex.check("a").ok and not ex.check(...).ok
    assert "fake tensors" in ex.reveal().message
