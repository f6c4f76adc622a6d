"""Lesson 10's reference-cycle experiments: the line that frees the tensor, measured by the line tracker,
checked against an independent observer (a weakref callback on the tensor's storage) and against gc."""
import gc
import weakref

import pytest
import torch

from gpulab.course.reference_cycles import (CYCLE_KINDS, Holder, cycle_code, cycle_members,
                                            exercise_cycle_frees, run_cycle)

N = 64 * 1024   # 256 KiB: quick


@pytest.mark.parametrize("kind, by_collector", [("self", True), ("traceback", True), ("break", False),
                                                ("weakref", False), ("message", False)])
def test_which_line_frees_the_tensor(kind, by_collector):
    run = run_cycle(kind, N)
    assert run.tensor_bytes == N * 4
    assert run.freed_by is not None
    assert run.freed_by_collector is by_collector
    # the report's last line (gc.collect) leaves only what the code still names: at most the 4-byte sum
    assert run.report.final_bytes <= 4
    assert gc.isenabled()


def test_cycle_survives_del_independently():
    """Without the tracker: a weakref on the storage says the same thing as the line report."""
    gc.collect()
    gc.disable()
    try:
        h = Holder(torch.zeros(N))
        h.me = h
        freed = []
        weakref.finalize(h.tensor.untyped_storage(), freed.append, True)
        del h
        assert freed == []
        assert gc.collect() >= 2    # the Holder and its __dict__ at least
        assert freed == [True]
    finally:
        gc.enable()


def test_delete_line_shows_no_removal_but_collect_does():
    run = run_cycle("self", N)
    del_step = next(s for s in run.report.steps if s.source.startswith("del holder"))
    gc_step = next(s for s in run.report.steps if "gc.collect" in s.source)
    assert del_step.removed == [] and del_step.delta_bytes == 0
    assert [t.nbytes for t in gc_step.removed] == [N * 4] and gc_step.delta_bytes == -N * 4


def test_collector_restored_after_an_error(monkeypatch):
    import gpulab.course.reference_cycles as rc

    def boom(*a, **k):
        raise RuntimeError("tracked code failed")
    monkeypatch.setattr(rc, "track_lines", boom)
    with pytest.raises(RuntimeError):
        rc.run_cycle("self", N)
    assert gc.isenabled()


def test_cycle_members_lists_the_cycle():
    m = cycle_members("self", N)
    assert "Holder" in m.types and m.tensors == (((N,), "float32", N * 4),)
    t = cycle_members("traceback", N)
    assert {"frame", "traceback", "RuntimeError"} <= set(t.types)
    assert t.tensors == (((N,), "float32", N * 4),)
    for kind in ("break", "weakref", "message"):
        assert cycle_members(kind, N).tensors == ()
    assert gc.get_debug() == 0 and gc.garbage == []


def test_exercise_reads_the_measurement():
    q = exercise_cycle_frees("self", N)
    assert q.check("b").ok and not q.check("a").ok and not q.check("c").ok
    assert "gc.collect" in q.reveal().message
    assert not q.check(...).ok and not q.check("z").ok


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_bad_numel(bad):
    with pytest.raises(ValueError, match="positive int"):
        cycle_code("self", bad)


def test_bad_kind():
    with pytest.raises(ValueError, match="choose one of"):
        run_cycle("nope")
    assert set(CYCLE_KINDS) == {"self", "break", "weakref", "traceback", "message"}
