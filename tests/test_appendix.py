"""The reference articles' claims live in one appendix (issue #26): lesson 15 has one section per
lesson 01-11 that calls that lesson's claims function(s) on evidence it computes itself, each
lesson points to its section instead of testing the claims, and the verdicts are still computed
from the evidence (doctored evidence flips them). Executing the appendix is test_robustness.py's
job, like every lesson's; the claims of lessons 01-08 are checked on real runs in the panel
tests (test_panels_*, test_sweeps, test_optimizers)."""
import re
from types import SimpleNamespace

import nbformat
import pytest

from conftest import LESSONS
from gpulab.course.allocator_claims import allocator_claims
from gpulab.course.claims import BREAKS, HOLDS
from gpulab.course.tracking_claims import tracking_claims, tracking_reports
from gpulab.units import GiB, MB, MiB

APPENDIX = LESSONS / "15_appendix_reference_claims.ipynb"
# each lesson's claims functions, as the appendix calls them
CLAIMS = {
    "01": ["tensor_claims(", "unit_claims("], "02": ["parameter_claims("],
    "03": ["cs231n_claims(", "flops_claims(", ".claims()", "modelsize_claims("], "04": ["sweep_claims("],
    "05": ["optimizer_claims("], "06": ["inplace_claims(", "inference_claims("], "07": ["checkpoint_claims("],
    "08": ["precision_claims("], "09": ["allocator_claims("], "10": ["tracking_claims("],
    "11": ["transformer_claims("],
}


def sections(nb) -> dict[str, list[str]]:
    """The appendix's "## NN · ..." sections: the code of each."""
    out, current = {}, None
    for c in nb.cells:
        if c.cell_type == "markdown":
            heads = re.findall(r"^## (.*)$", c.source, re.M)
            if heads:
                m = re.match(r"(\d\d) · ", heads[-1])
                current = m.group(1) if m else None
                if current:
                    out[current] = []
        elif current:
            out[current].append(c.source)
    return out


def test_one_section_per_lesson_calls_its_claims_functions():
    found = sections(nbformat.read(APPENDIX, as_version=4))
    assert sorted(found) == sorted(CLAIMS)
    for number, calls in CLAIMS.items():
        code = "\n".join(found[number])
        for call in calls:
            assert call in code, f"section {number} does not call {call}"
        assert "panel" not in code, f"section {number}: compute the evidence directly, not through a panel"


def test_section_04_uses_the_sweep_panels_default_batches():
    from gpulab.widgets.sweep import sweep_batches

    code = "\n".join(sections(nbformat.read(APPENDIX, as_version=4))["04"])
    assert f'batch_sweep("cnn", {sweep_batches(32)}, optimizer="adam", steps=2)' in code


def test_the_appendix_has_time_check_yourself_and_answers():
    nb = nbformat.read(APPENDIX, as_version=4)
    first = next(c.source for c in nb.cells if c.cell_type == "markdown")
    assert re.search(r"\*\*Time:\*\* about \d+ minutes in full; core path about 0 minutes "
                     r"\(optional reading after the workshop\)", first)
    assert "**Check yourself" in first
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "## Questions" in text and "<details><summary>Answers</summary>" in text


@pytest.mark.parametrize("number", sorted(CLAIMS))
def test_each_lesson_points_to_its_section_instead(number):
    (path,) = LESSONS.glob(f"{number}_*.ipynb")
    nb = nbformat.read(path, as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert not re.search(r"\b\w+_claims\(", code), f"lesson {number} still tests claims"
    assert not re.search(r"^## .*claim", text, re.M | re.I), f"lesson {number} still has a claims section"
    assert re.search(rf"15_appendix_reference_claims\.ipynb\S*, section {number}\b", text)


# --- the verdicts follow the evidence ---------------------------------------------------------------

def _step(tensors, allocated, reserved):
    return SimpleNamespace(tracked_peak=tensors, peak_allocated=allocated, peak_reserved=reserved,
                           source_label="measured on CPU (live tensors)")


def _cost(off_calls, on_calls, off_reserved=20 * MiB, on_reserved=20 * MiB):
    return {"without": {"cudaMalloc calls": off_calls, "cudaFree calls": 0, "peak reserved": off_reserved},
            "with empty_cache": {"cudaMalloc calls": on_calls, "cudaFree calls": on_calls,
                                 "peak reserved": on_reserved}}


NO_GPU = {"bytes": None, "label": "not measurable here"}


def test_allocator_verdicts_flip_with_the_evidence():
    good = allocator_claims(_step(10 * MiB, 10 * MiB, 16 * MiB), _cost(4, 13), NO_GPU)
    assert [c.verdict for c in good] == [HOLDS, "holds as a direction (counts, not times)", "cannot be tested here"]
    # reserved below the tensors, no extra cudaMalloc calls, a GPU that reads 2 GiB beyond the allocator
    bad = allocator_claims(_step(10 * MiB, 10 * MiB, 8 * MiB), _cost(4, 4),
                           {"bytes": 2 * GiB, "label": "measured on a test GPU (cuda)"})
    assert [c.verdict for c in bad] == [BREAKS, BREAKS, BREAKS]
    # empty_cache that lowered the peak reserved memory does not "slow training" by this count
    assert allocator_claims(_step(1, 1, 1), _cost(4, 13, on_reserved=10 * MiB), NO_GPU)[1].verdict == BREAKS
    near = allocator_claims(_step(1, 1, 2), _cost(4, 13), {"bytes": 420 * MB, "label": "measured (cuda)"})
    assert near[2].verdict == HOLDS


@pytest.fixture(scope="module")
def reports():
    return tracking_reports(engine="cpu")


def test_tracking_verdicts_come_from_the_reports(reports):
    view, leaky = reports
    assert [c.verdict for c in tracking_claims(view, leaky)] == [
        HOLDS, BREAKS, "holds, when something else references their storage"]


def test_tracking_verdicts_flip_with_doctored_reports(reports):
    import dataclasses

    view, leaky = reports
    # hundreds of MB alive before the first line: the "already used" claim would hold
    first = leaky.steps[0]
    early = dataclasses.replace(leaky, steps=[dataclasses.replace(first, total_bytes=first.total_bytes + 300 * MiB,
                                                                  delta_bytes=first.delta_bytes)] + leaky.steps[1:])
    assert tracking_claims(view, early)[1].verdict == HOLDS
    # `del a` that freed the storage (no view kept it): "still hold memory" breaks
    line = next(s.line for s in view.steps if "del a" in s.source)
    storage = next(t for s in view.steps for t in s.added)
    freed = [dataclasses.replace(s, removed=[storage], total_bytes=0) if s.line == line else s for s in view.steps]
    assert tracking_claims(dataclasses.replace(view, steps=freed), leaky)[2].verdict == BREAKS
    # a line report whose tensors are not tied to lines: "line by line" breaks
    lost = [dataclasses.replace(s, added=[dataclasses.replace(t, where="") for t in s.added]) for s in leaky.steps]
    assert tracking_claims(view, dataclasses.replace(leaky, steps=lost))[0].verdict == BREAKS


def test_the_predict_first_answer_comes_from_the_verdicts(monkeypatch):
    import gpulab.course.appendix_claims as A
    from gpulab.course.claims import ClaimCheck

    def cards(breaking):
        return {k: ClaimCheck(k, "ref 003", BREAKS if k == breaking else HOLDS, "because") for k in "abc"}

    question = A.exercise_which_breaks()
    monkeypatch.setattr(A, "which_breaks_checks", lambda: cards("c"))
    assert question.check("c") and not question.check("b")
    monkeypatch.setattr(A, "which_breaks_checks", lambda: cards("b"))
    assert question.check("b") and not question.check("c")
