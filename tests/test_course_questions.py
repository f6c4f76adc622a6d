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


def _right_and_wrong(ex, right, wrong):
    ok = ex.check(right)
    assert ok.ok and ok.expected == right and len(ok.message) > 40
    bad = ex.check(wrong)
    assert not bad.ok and bad.expected == right and f"Not ({wrong})" in bad.message


def test_lessons_00_to_02_qualitative_questions():
    from gpulab.course.parameters import conv_linear_params, exercise_conv_or_linear
    from gpulab.course.byte_units import exercise_mb_vs_mib
    from gpulab.course.tensor_bytes import exercise_which_frees
    _right_and_wrong(exercise_mb_vs_mib(3_000_000), "a", "b")
    assert "MiB" in exercise_mb_vs_mib().reveal().message
    frees = exercise_which_frees((4, 3, 10, 10), "float32")
    _right_and_wrong(frees, "d", "a")
    assert "clone" in frees.options["d"]
    counts = conv_linear_params("vgg16")
    assert counts == {"Conv2d": 14_714_688, "Linear": 123_642_856}
    _right_and_wrong(exercise_conv_or_linear("vgg16"), "b", "a")


def test_lessons_03_to_05_qualitative_questions():
    from gpulab.course.activations import exercise_where_activations, first_block_vs_classifier
    from gpulab.course.anatomy import exercise_peak_category, fake_cuda_differences
    from gpulab.course.optimizers import exercise_sgd_state
    d = first_block_vs_classifier("vgg16")
    assert d["first block"] > 100 * d["classifier"]
    _right_and_wrong(exercise_where_activations("vgg16"), "a", "b")
    peak = exercise_peak_category("cnn", batch=32, optimizer="adam")
    _right_and_wrong(peak, "d", "c")
    assert "backward 2" in peak.reveal().message
    _right_and_wrong(exercise_sgd_state("mlp"), "a", "b")
    assert "cuBLAS" in repr(fake_cuda_differences())


def _numeric_exercises():
    """Every exercise_* factory of the course that builds with its defaults and checks a number."""
    import importlib
    import inspect
    import pkgutil

    import gpulab.course as course
    from gpulab.course.exercises import Exercise

    for info in pkgutil.iter_modules(course.__path__):
        mod = importlib.import_module(f"gpulab.course.{info.name}")
        for name, fn in vars(mod).items():
            if not (name.startswith("exercise_") and inspect.isfunction(fn) and fn.__module__ == mod.__name__):
                continue
            if any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                   for p in inspect.signature(fn).parameters.values()):
                continue
            ex = fn()
            if isinstance(ex, Exercise):
                yield f"{info.name}.{name}", ex


def test_numeric_checkers_say_not_a_size_for_nan_inf_and_huge_numbers():
    """Lessons 04 and 10 crashed on these; every numeric checker answers instead."""
    seen = []
    for name, ex in _numeric_exercises():
        seen.append(name)
        for bad in (float("nan"), float("inf"), -float("inf"), 10 ** 400, "nan"):
            r = ex.check(bad)
            assert not r.ok and "not a size" in r.message, (name, bad, r.message)
    assert len(seen) >= 5, seen


def test_a_ratio_checker_calls_close_only_what_is_close():
    """Lesson 14's FLOPs ratio (about 1.2) called 1.0 and 2.0 "close" under the size checkers' factor
    of 2; its checker now says close only within 10%, and a size checker keeps its factor of 2."""
    from gpulab.course.exercises import Exercise
    ratio = Exercise("a FLOPs ratio", expected=lambda: 1.216, explain="", rel_tol=0.03, close=1.1, hint="Count.")
    assert ratio.check(1.216).ok and ratio.check(1.24).ok
    assert "Close" in ratio.check(1.33).message
    for far in (1.0, 2.0, 0.5):
        r = ratio.check(far)
        assert not r.ok and "Close" not in r.message and "Count." in r.message, (far, r.message)
    size = Exercise("bytes", expected=lambda: 1000, explain="", rel_tol=0.0)
    assert "Close" in size.check(1500).message and "Close" not in size.check(2500).message
