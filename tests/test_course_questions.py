"""The predict-first checkers and citation links added for the workshop (issue 11)."""

from gpulab.course.checkpointing import checkpoint_sequential_maps, chen_maps, exercise_checkpoint_maps, exercise_many_segments
from gpulab.course.claims import source_html
from gpulab.course.exercises import ChoiceExercise, exercise_detach_keeps, exercise_empty_cache_partial
from gpulab.course.inplace import inplace_break
from gpulab.course.precision import autocast_grad_dtypes, exercise_autocast_grad_dtypes


def test_checkpoint_exercise_explains_chens_count():
    ex = exercise_checkpoint_maps(16, 4)
    assert checkpoint_sequential_maps(16, 4) == 7 and chen_maps(16, 4) == 8
    assert ex.check(7).ok
    wrong = ex.check(8)
    assert not wrong.ok and "model's input" in wrong.message


def test_many_segments_is_no_saving():
    assert exercise_many_segments(16, 12).check("c").ok
    assert not exercise_many_segments(16, 12).check("a").ok


def test_choice_exercise_rejects_unknown_keys():
    ex = ChoiceExercise("q", {"a": "x", "b": "y"}, expected=lambda: "b", explain="because")
    assert not ex.check(...).ok and not ex.check("z").ok and ex.check(" B ").ok


def test_data_write_gives_a_silently_wrong_gradient():
    r = inplace_break("sigmoid then .data.mul_")
    assert r.version_before == r.version_after == 0 and r.error is None
    assert r.silently_wrong
    assert inplace_break("linear then relu_").grad_matches is True


def test_autocast_gradient_dtypes_match_torch():
    d = autocast_grad_dtypes("bfloat16")
    assert d["activation gradient (into the first Linear's output)"] == "bfloat16"
    assert d["first Linear's weight.grad"] == "float32"
    assert exercise_autocast_grad_dtypes("bfloat16").check("c").ok


def test_allocator_and_tracking_questions():
    assert exercise_empty_cache_partial(6).check("a").ok
    assert exercise_detach_keeps().check("b").ok


def test_claim_sources_link_to_references():
    html = source_html("cs231n notes, quoted in articles 000 and 003")
    assert "references.md#ref-000" in html and "references.md#ref-003" in html and "article" not in html
