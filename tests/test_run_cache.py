"""Issue #34, item 3: one answer's fake runs are reused by the next (``gpulab.predict.run_cache``).

A second identical ``gpulab.fit`` in the same process makes no fake run and gives the same answer;
changing any part of the key (workload, recipe, dtype, batch, card, gpulab's version) misses; a
workload of the user's own is never kept; what the cache hands out can be changed by the caller
without changing what it keeps.
"""
from __future__ import annotations


import pytest
import torch
from torch import nn

import gpulab
from gpulab.models.workload import resolve_workload
from gpulab.predict import fake_runs as fake_runs_module
from gpulab.predict import fit as fit_module
from gpulab.predict import run_cache
from gpulab.predict.what_fits import what_fits
from gpulab.training.loop import user_recipe


@pytest.fixture
def fake_runs(monkeypatch):
    """The fake runs actually made (batch of each), with an empty cache before and after."""
    run_cache.clear()
    made: list[int] = []
    real = fake_runs_module.fake_run

    def counted(w, batch, dt, recipe, *timed):   # timed: the OpTimer's box and first step (predict.run_ops)
        made.append(batch)
        return real(w, batch, dt, recipe, *timed)
    monkeypatch.setattr(fake_runs_module, "fake_run", counted)
    yield made
    run_cache.clear()


def _answer(r) -> dict:
    """The answer without what measures the answering itself (its wall time); the predicted step time,
    costed from the kept runs' ops, is part of the answer and must be identical."""
    d = r.as_dict()
    d.pop("seconds")
    return d


def test_a_second_identical_fit_makes_no_fake_run_and_gives_the_same_answer(fake_runs):
    first = gpulab.fit("mlp", "T4")
    n = len(fake_runs)
    assert n == first.runs == 3                 # batches 2, 3 and the answer
    second = gpulab.fit("mlp", "T4")
    assert len(fake_runs) == n                  # nothing run again
    assert _answer(second) == _answer(first) and second.runs == first.runs
    assert first.time is not None and second.time.as_dict() == first.time.as_dict()   # T4 has speed figures
    assert run_cache.info()["hits"] == 3


def test_what_fits_reuses_the_runs_fit_made_at_its_batch(fake_runs):
    gpulab.fit("mlp", "T4", optimizer="adamw")
    before = list(fake_runs)
    r = what_fits("mlp", "T4", batch=2, optimizer="adamw")
    assert r.asked_fits
    # each candidate run, but 8-bit AdamW's, derived from the asked recipe's timeline (predict.eight_bit_timeline);
    # the asked recipe: fit's run
    derived = [t for t in r.tried if t.changes == {"optimizer": "adamw8bit"}]
    assert len(derived) == 1 and len(fake_runs) - len(before) == len(r.tried) - 1
    again = list(fake_runs)
    what_fits("mlp", "T4", batch=2, optimizer="adamw")
    assert fake_runs == again                    # every candidate kept from the first call
    from gpulab.predict.replay import replay_events, tracked_events
    eight = gpulab.step("mlp", batch=2, engine="fake", optimizer="adamw8bit")   # the derived one, as its own run
    assert derived[0].reserved_bytes == max(replay_events(tracked_events(eight.measurement)).reserved)


def _tracked(w, batch=2, dtype=torch.float32, recipe=None, card="T4", key=None):
    key = run_cache.workload_key("mlp", w, own_parts=False) if key is None else key
    return fit_module._tracked(w, key, batch, dtype, recipe or user_recipe("adam", None), ("cuda", card))


def test_each_part_of_the_key_misses(fake_runs, monkeypatch):
    w = resolve_workload("mlp")
    _tracked(w)
    assert len(fake_runs) == 1
    _tracked(resolve_workload("mlp"))             # the same question, a new workload object: kept
    assert len(fake_runs) == 1
    changes = [dict(batch=3), dict(dtype=torch.bfloat16), dict(recipe=user_recipe("sgd", None)),
               dict(recipe=user_recipe("adam", None, accumulate=2)), dict(card="H100"),
               dict(w=resolve_workload("mlp", image_size=16),
                    key=run_cache.workload_key("mlp", resolve_workload("mlp", image_size=16), own_parts=False))]
    for i, change in enumerate(changes):
        kw = {"w": w, **change}
        _tracked(**kw)
        assert len(fake_runs) == 2 + i, change
    monkeypatch.setattr(gpulab, "__version__", gpulab.__version__ + ".dev1")
    _tracked(w)
    assert len(fake_runs) == 2 + len(changes)    # another gpulab: run again


def test_a_workload_of_the_users_own_is_never_kept(fake_runs):
    net = nn.Sequential(nn.Linear(8, 8))
    gpulab.fit(net, "T4", input_shape=(8,))
    n = len(fake_runs)
    gpulab.fit(net, "T4", input_shape=(8,))
    assert len(fake_runs) == 2 * n and run_cache.info()["entries"] == 0
    w = resolve_workload("mlp", loss=lambda out: out.sum())
    assert run_cache.workload_key("mlp", w, own_parts=True) is None


def test_a_transformer_config_is_part_of_its_key():
    from gpulab.models import hf_configs
    config = hf_configs.make_config(hf_configs.hf_entry("hf:tiny-gpt2"))
    w = resolve_workload(config, seq_len=16)
    key = run_cache.workload_key(config, w, own_parts=False)
    config.n_layer += 1
    assert run_cache.workload_key(config, resolve_workload(config, seq_len=16), own_parts=False) != key


def test_what_the_cache_hands_out_cannot_change_what_it_keeps(fake_runs):
    w = resolve_workload("mlp")
    t = _tracked(w)
    peak, events, records = t.peak_bytes, len(t.events), len(t.records)
    t.events.clear()
    t.series.clear()
    t.peak_by_category["parameters"] = -1
    next(iter(t.records.values())).nbytes = -1
    t.records.clear()
    again = _tracked(w)
    assert len(fake_runs) == 1
    assert (again.peak_bytes, len(again.events), len(again.records)) == (peak, events, records)
    assert again.peak_by_category["parameters"] > 0 and all(r.nbytes >= 0 for r in again.records.values())


def test_fresh_runs_again_and_keeps_the_new_one(fake_runs):
    w = resolve_workload("mlp")
    key = run_cache.workload_key("mlp", w, own_parts=False)
    recipe = user_recipe("adam", None)
    fit_module._tracked(w, key, 2, torch.float32, recipe, ("cuda", "T4"))
    fit_module._tracked(w, key, 2, torch.float32, recipe, ("cuda", "T4"), fresh=True)
    fit_module._tracked(w, key, 2, torch.float32, recipe, ("cuda", "T4"))
    assert fake_runs == [2, 2] and run_cache.info()["entries"] == 1


def test_the_oldest_go_first_when_the_events_pass_the_bound(fake_runs, monkeypatch):
    w = resolve_workload("mlp")
    one = _tracked(w)
    monkeypatch.setattr(run_cache, "MAX_EVENTS", 2 * len(one.events) + 1)
    _tracked(w, batch=3)
    assert run_cache.info()["entries"] == 2
    _tracked(w, batch=4)                         # three timelines pass the bound: batch 2's goes
    assert run_cache.info()["entries"] == 2 and len(fake_runs) == 3
    _tracked(w, batch=3)
    assert len(fake_runs) == 3
    _tracked(w)
    assert len(fake_runs) == 4
