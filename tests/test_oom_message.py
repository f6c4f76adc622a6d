"""Reading CUDA out-of-memory messages (gpulab.interop.oom_message).

The formats come from PyTorch's source, c10/cuda/CUDACachingAllocator.cpp,
``DeviceCachingAllocator::malloc`` (the TORCH_CHECK_WITH(OutOfMemoryError, ...) after
``alloc_block`` failed) and ``reportProcessMemoryInfo``:

* current, read at pytorch/pytorch commit 001074d25084fdb87a799823e395a50f5ec044d3:
      "CUDA out of memory. Tried to allocate ", format_size(alloc_size), ". GPU ",
      static_cast<int>(device), " has a total capacity of ", format_size(device_total),
      " of which ", format_size(device_free), " is free. ", proc_info, allowed_info,
      "Of the allocated memory ", format_size(allocated_bytes + allocated_in_private_pools),
      " is allocated by PyTorch, ", private_pool_msg, "and ",
      format_size(reserved_bytes - allocated_bytes - allocated_in_private_pools),
      " is reserved by PyTorch but unallocated.",
      " If reserved but unallocated memory is large try setting",
      " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid",
      " fragmentation.  See documentation for Memory Management ",
      " (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
  with proc_info = "Including non-PyTorch memory, this process" / "Process " << pid, then
  " has " << format_size(usedGpuMemory) << " memory in use. " per NVML process;
  allowed_info = format_size(allowed_memory_maximum) + " allowed; ";
  private_pool_msg = "with " + format_size(...) + " allocated in private pools (e.g., CUDA Graphs), ".
  torch 2.15.0 (git d0f2af8b66b20da4baa50644c0cd3f887a2eae2e) has the same text with the URL
  https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf
  (its libc10_cuda.so holds every fragment: test_current_format_is_the_installed_torchs).
* legacy (1.x), the same function in older releases:
      "CUDA out of memory. Tried to allocate ", format_size(alloc_size), " (GPU ", device, "; ",
      format_size(device_total), " total capacity; ", format_size(allocated), " already allocated; ",
      format_size(device_free), " free; ", allowed_info, format_size(reserved),
      " reserved in total by PyTorch)"
  later followed by " If reserved memory is >> allocated memory try setting max_split_size_mb to avoid"
  " fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF".
"""
from __future__ import annotations

import pathlib
import random
import string

import pytest
import torch

from gpulab.interop import oom_message as O
from gpulab.allocator.simulator import GiB, MiB, CachingAllocator, SimulatedOutOfMemoryError, format_size
from gpulab.predict.replay import fragmentation_events

KiB = 1024

# figures whose format_size is easy to read: 20.00 MiB, 15.00 GiB, 123.50 MiB, 12.25 GiB, 1.50 GiB
TRIED, TOTAL, FREE, ALLOC, RESERVED = 20 * MiB, 15 * GiB, int(123.5 * MiB), int(12.25 * GiB), int(13.75 * GiB)

CURRENT_EXPECTED = (
    "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 15.00 GiB of which "
    "123.50 MiB is free. Process 4242 has 1.50 GiB memory in use. Including non-PyTorch memory, this process "
    "has 14.25 GiB memory in use. Of the allocated memory 12.25 GiB is allocated by PyTorch, and 1.50 GiB is "
    "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
    "Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)")
LEGACY_EXPECTED = (
    "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.00 GiB total capacity; 12.25 GiB already "
    "allocated; 123.50 MiB free; 13.75 GiB reserved in total by PyTorch) If reserved memory is >> allocated "
    "memory try setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management "
    "and PYTORCH_CUDA_ALLOC_CONF")


def _current(**kw):
    args = dict(this_process=RESERVED + GiB // 2, other_processes=[(4242, 3 * GiB // 2)])
    args.update(kw)
    return O.format_oom_message(TRIED, TOTAL, FREE, ALLOC, RESERVED, **args)


def test_format_is_pytorchs_text_character_for_character():
    assert _current() == CURRENT_EXPECTED
    assert O.format_oom_message(TRIED, TOTAL, FREE, ALLOC, RESERVED, style="legacy") == LEGACY_EXPECTED
    assert O.format_oom_message(TRIED, TOTAL, FREE, ALLOC, RESERVED, style="legacy-plain") == \
        LEGACY_EXPECTED[:LEGACY_EXPECTED.index(")") + 1]
    old_url = _current(style="2.x")
    assert old_url.endswith("Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
    with_pools = _current(private_pools=256 * MiB, allowed=14 * GiB, other_processes=())
    assert ("of which 123.50 MiB is free. Including non-PyTorch memory, this process has 14.25 GiB memory in use. "
            "14.00 GiB allowed; Of the allocated memory 12.50 GiB is allocated by PyTorch, with 256.00 MiB allocated "
            "in private pools (e.g., CUDA Graphs), and 1.25 GiB is reserved by PyTorch but unallocated.") in with_pools
    with pytest.raises(ValueError, match="unknown style"):
        O.format_oom_message(1, 2, 3, 4, 5, style="3.0")


def _libc10_cuda() -> pathlib.Path | None:
    p = pathlib.Path(torch.__file__).parent / "lib" / "libc10_cuda.so"
    return p if p.is_file() else None


@pytest.mark.skipif(_libc10_cuda() is None, reason="this torch build has no libc10_cuda.so")
def test_current_format_is_the_installed_torchs():
    """Every literal fragment of the current format is a string in the installed libc10_cuda.so.
    The advice is looked for in its two halves: torch 2.11's library holds it as two literals
    (" ...try setting" and " PYTORCH_CUDA_ALLOC_CONF=..."), torch 2.15's as one."""
    lib = _libc10_cuda().read_bytes()
    advice = O.ADVICE_CURRENT.format(url=O.DOCS_URL_CURRENT)
    cut = advice.index(" PYTORCH_CUDA_ALLOC_CONF")
    fragments = ["CUDA out of memory. Tried to allocate ", ". GPU ", " has a total capacity of ", " of which ",
                 " is free. ", "Including non-PyTorch memory, this process", " memory in use. ", " allowed; ",
                 "Of the allocated memory ", " is allocated by PyTorch, ",
                 " allocated in private pools (e.g., CUDA Graphs), ", " is reserved by PyTorch but unallocated.",
                 advice[:cut], advice[cut:]]
    missing = [f for f in fragments if f.encode() not in lib]
    assert not missing, f"not in {torch.__version__}'s libc10_cuda.so: {missing}"


# ---- parsing every figure -------------------------------------------------------------------------

def _close(amount: O.Amount, nbytes: int) -> bool:
    return abs(amount.bytes - nbytes) <= amount.resolution


@pytest.mark.parametrize("style", ["current", "2.x", "legacy", "legacy-plain"])
@pytest.mark.parametrize("prefix", ["", "torch.OutOfMemoryError: ", "torch.cuda.OutOfMemoryError: ",
                                    "RuntimeError: ", "Traceback (most recent call last):\n  File \"t.py\", line 3\n"
                                                      "    y = x @ x\ntorch.OutOfMemoryError: "])
def test_every_figure_is_read_in_every_format(style, prefix):
    text = prefix + O.format_oom_message(TRIED, TOTAL, FREE, ALLOC, RESERVED, style=style,
                                         this_process=RESERVED + GiB // 2, other_processes=[(4242, 3 * GiB // 2)])
    m = O.parse_oom_message(text)
    assert m.format == (O.FORMAT_LEGACY if style.startswith("legacy") else O.FORMAT_CURRENT)
    assert m.kind == "CUDA" and m.gpu == 0 and not m.simulated
    for amount, want in ((m.tried, TRIED), (m.total, TOTAL), (m.free, FREE), (m.allocated, ALLOC),
                         (m.reserved, RESERVED), (m.unallocated, RESERVED - ALLOC)):
        assert _close(amount, want), (amount, want)
    if style.startswith("legacy"):
        assert m.this_process is None and m.other_processes == ()
        assert m.advice == ("max_split_size_mb" if style == "legacy" else "")
    else:
        assert _close(m.this_process, RESERVED + GiB // 2)
        assert [(pid, a.text) for pid, a in m.other_processes] == [(4242, "1.50 GiB")]
        assert m.advice == "expandable_segments"
    assert m.tried.text == "20.00 MiB" and m.tried.resolution == MiB // 200


def test_optional_parts_allowed_private_pools_and_devices():
    m = O.parse_oom_message(O.format_oom_message(TRIED, TOTAL, FREE, ALLOC, RESERVED, gpu=3, allowed=14 * GiB,
                                                 private_pools=256 * MiB))
    assert m.gpu == 3 and _close(m.allowed, 14 * GiB) and _close(m.private_pools, 256 * MiB)
    assert _close(m.allocated, ALLOC + 256 * MiB)     # "allocated by PyTorch" includes the private pools
    assert _close(m.unallocated, RESERVED - ALLOC - 256 * MiB)
    legacy = O.parse_oom_message(O.format_oom_message(TRIED, TOTAL, FREE, ALLOC, RESERVED, style="legacy",
                                                      allowed=14 * GiB, gpu=1))
    assert legacy.gpu == 1 and _close(legacy.allowed, 14 * GiB)
    hip = O.parse_oom_message(_current().replace("CUDA out of memory", "HIP out of memory"))
    assert hip.kind == "HIP"


def test_small_figures_in_bytes_and_kib():
    m = O.parse_oom_message(O.format_oom_message(2 * MiB, 8 * GiB, 0, 700, 2 * MiB))
    assert m.free.text == "0 bytes" and m.free.bytes == 0 and m.free.resolution == 0
    assert m.allocated.text == "700 bytes" and m.allocated.bytes == 700
    assert m.unallocated.text == "2.00 MiB" and _close(m.unallocated, 2 * MiB - 700)
    # format_size switches unit only past the boundary: 1 GiB prints as "1024.00 MiB"
    assert O.Amount.parse(format_size(GiB)).text == "1024.00 MiB" and O.Amount.parse("1024.00 MiB").bytes == GiB


def test_wrapped_and_spaced_text():
    wrapped = _current().replace(" GPU 0 has", "\nGPU 0\n has").replace("  See", "\n\nSee")
    assert O.parse_oom_message(wrapped).tried.text == "20.00 MiB"


def test_messages_as_users_paste_them():
    """Whole messages from public bug reports (PyTorch 2.x and 1.x), read as users paste them."""
    two = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 19.68 GiB. GPU 0 has a total capacity of "
           "23.68 GiB of which 11.88 GiB is free. Including non-PyTorch memory, this process has 11.79 GiB memory in "
           "use. Of the allocated memory 11.44 GiB is allocated by PyTorch, and 43.59 MiB is reserved by PyTorch but "
           "unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF="
           "expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  "
           "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
    m = O.parse_oom_message(two)
    assert (m.tried.text, m.free.text, m.this_process.text, m.unallocated.text) == \
        ("19.68 GiB", "11.88 GiB", "11.79 GiB", "43.59 MiB")
    assert O.diagnose(m).case == "too_big"
    one = ("RuntimeError: CUDA out of memory. Tried to allocate 600.00 MiB (GPU 0; 5.77 GiB total capacity; "
           "2.46 GiB already allocated; 539.44 MiB free; 3.19 GiB reserved in total by PyTorch) If reserved memory "
           "is >> allocated memory try setting max_split_size_mb to avoid fragmentation.  See documentation for "
           "Memory Management and PYTORCH_CUDA_ALLOC_CONF")
    m1 = O.parse_oom_message(one)
    assert m1.format == O.FORMAT_LEGACY and m1.unallocated.text == format_size(m1.reserved.bytes - m1.allocated.bytes)
    assert O.diagnose(m1).case == "fragmentation"


def test_torch_2_1_messages_with_its_spelling_of_capacity():
    """PyTorch 2.1 wrote "total capacty" (pytorch/pytorch PR #99699, April 2023, which introduced the
    current wording; later corrected) and still advised max_split_size_mb. Whole messages as users
    pasted them from torch 2.1 runs."""
    one = ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.15 GiB. GPU 0 has a total capacty "
           "of 23.69 GiB of which 912.81 MiB is free. Process 454738 has 22.79 GiB memory in use. Of the allocated "
           "memory 21.50 GiB is allocated by PyTorch, and 1001.89 MiB is reserved by PyTorch but unallocated. If "
           "reserved but unallocated memory is large try setting max_split_size_mb to avoid fragmentation.  See "
           "documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF")
    m = O.parse_oom_message(one)
    assert m.format == O.FORMAT_CURRENT and m.advice == "max_split_size_mb"
    assert (m.tried.text, m.total.text, m.free.text, m.allocated.text, m.unallocated.text) == \
        ("1.15 GiB", "23.69 GiB", "912.81 MiB", "21.50 GiB", "1001.89 MiB")
    assert [(pid, a.text) for pid, a in m.other_processes] == [(454738, "22.79 GiB")] and m.this_process is None
    assert O.reproduce(one).diagnosis.case == O.diagnose(m).case
    two = ("CUDA out of memory. Tried to allocate 102.00 MiB. GPU 0 has a total capacty of 39.38 GiB of which "
           "29.81 MiB is free. Including non-PyTorch memory, this process has 39.32 GiB memory in use. Of the "
           "allocated memory 37.54 GiB is allocated by PyTorch, and 1.12 GiB is reserved by PyTorch but unallocated. "
           "If reserved but unallocated memory is large try setting max_split_size_mb to avoid fragmentation.  See "
           "documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF")
    m2 = O.parse_oom_message(two)
    assert m2.this_process.text == "39.32 GiB" and m2.unallocated.text == "1.12 GiB"


@pytest.mark.parametrize("not_text", [_current().encode(), None, 42, ["CUDA out of memory"]],
                         ids=["bytes", "None", "int", "list"])
def test_not_text_is_refused_by_name(not_text):
    """bytes (a file opened in binary mode), None (an empty widget, a failed read): a ValueError that
    names what was passed and what to pass, from every entry point, never an AttributeError."""
    for read in (O.parse_oom_message, O.diagnose, O.reproduce):
        with pytest.raises(ValueError, match=rf"expected text \(a str\), got {type(not_text).__name__}"):
            read(not_text)


# ---- the cases ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("figures, case", [
    # tried, total, free, allocated, reserved, others, allowed
    ((600 * MiB, 16 * GiB, 500 * MiB, 12 * GiB, 13 * GiB, [], None), "fragmentation"),
    ((4 * GiB, 16 * GiB, 500 * MiB, 14 * GiB, int(14.5 * GiB), [], None), "too_big"),
    ((2 * GiB, 16 * GiB, 200 * MiB, 5 * GiB, int(5.1 * GiB), [(7, 10 * GiB)], None), "other_processes"),
    ((20 * GiB, 16 * GiB, 10 * GiB, 4 * GiB, 4 * GiB, [], None), "larger_than_gpu"),
    ((2 * GiB, 16 * GiB, 10 * GiB, 7 * GiB, int(7.5 * GiB), [], 8 * GiB), "memory_limit"),
])
def test_cases(figures, case):
    tried, total, free, alloc, reserved, others, allowed = figures
    text = O.format_oom_message(tried, total, free, alloc, reserved, other_processes=others, allowed=allowed,
                                this_process=reserved + 400 * MiB)
    d = O.diagnose(text)
    assert d.case == case, d.reasons
    assert d.levers and d.title and "CUDA context" in " ".join(d.reasons)
    html = d._repr_html_()
    assert f"case: {case}" in html and "What to do" in html
    if case == "fragmentation":
        assert "expandable_segments:True" in d.levers[0] and "max_split_size_mb" in d.levers[1]
    if case == "too_big":
        assert any("lesson 07" in x for x in d.levers) and any("lesson 12" in x for x in d.levers)
        assert d.shortfall_bytes > 0


def test_segment_sizes_are_explained():
    d = O.diagnose(O.format_oom_message(20 * MiB, 16 * GiB, 0, 15 * GiB, 15 * GiB))
    assert any("1–10 MiB requests get a 20 MiB segment" in r for r in d.reasons)
    assert O.request_for(20 * MiB) == 20 * MiB and O.request_for(2 * MiB) == MiB
    assert O.get_allocation_size(O.request_for(600 * MiB)) == 600 * MiB


# ---- rebuilt in the simulator ------------------------------------------------------------------------------

def test_a_fragmentation_message_is_reproduced_and_expandable_segments_fit():
    text = O.format_oom_message(600 * MiB, 16 * GiB, 500 * MiB, 12 * GiB, 13 * GiB, this_process=int(13.4 * GiB))
    r = O.reproduce(text)
    assert r.reproduced and r.holes > 0 and r.hole_bytes < r.request_bytes
    sim = r.simulated_message
    assert sim.simulated and sim.tried.text == "600.00 MiB"
    m = r.diagnosis.message
    assert abs(sim.free.bytes - m.free.bytes) <= 2 * MiB
    assert abs(sim.allocated.bytes - m.allocated.bytes) <= 2 * MiB
    assert abs(sim.unallocated.bytes - m.unallocated.bytes) <= 2 * MiB
    outcomes = {o.setting: o.ok for o in r.outcomes}
    assert outcomes["expandable_segments:True"] is True
    assert any(k.startswith("max_split_size_mb") for k in outcomes)
    assert "simulated allocator" in r._repr_html_()


def test_a_too_big_message_needs_less_memory_not_another_setting():
    r = O.reproduce(O.format_oom_message(4 * GiB, 16 * GiB, 500 * MiB, 14 * GiB, int(14.5 * GiB)))
    assert r.diagnosis.case == "too_big" and r.reproduced
    o = {x.setting: x.ok for x in r.outcomes}
    assert o["expandable_segments:True"] is False
    smaller = [k for k in o if k.startswith("live tensors")]
    assert smaller and o[smaller[0]] is True


def test_other_processes_closed_fits():
    r = O.reproduce(O.format_oom_message(2 * GiB, 16 * GiB, 200 * MiB, 5 * GiB, int(5.1 * GiB),
                                         other_processes=[(7, 10 * GiB)]))
    assert r.reproduced and {x.setting: x.ok for x in r.outcomes}["other processes closed"] is True


def test_simulated_oom_from_a_timeline_reads_back_exactly():
    """simulated_oom formats the simulator's own figures; parsing gives them back within
    format_size's two decimals, and the allocator agrees."""
    ev = fragmentation_events(n=8, block_mib=6, big_mib=12)
    oom = O.simulated_oom(ev, 80 * MiB, context_bytes=16 * MiB)
    assert oom is not None
    alloc, live = CachingAllocator(capacity_bytes=64 * MiB), {}
    with pytest.raises(SimulatedOutOfMemoryError) as err:
        for e in ev:  # the same replay by hand, to the first failure
            if e["kind"] == "alloc":
                live[e["sid"]] = alloc.malloc(e["nbytes"])
            else:
                alloc.free(live.pop(e["sid"]))
    assert err.value.allocated == oom.allocated and err.value.reserved == oom.reserved
    m = O.parse_oom_message(oom.text)
    assert m.tried.bytes == oom.tried == err.value.alloc_size == 12 * MiB
    assert _close(m.free, oom.free) and _close(m.allocated, oom.allocated) and _close(m.reserved, oom.reserved)
    assert _close(m.this_process, oom.reserved + 16 * MiB) and _close(m.total, 80 * MiB)
    assert O.simulated_oom(ev, 10 * GiB) is None
    with pytest.raises(ValueError, match="leaves nothing"):
        O.simulated_oom(ev, MiB, context_bytes=2 * MiB)


def test_the_simulators_own_message_is_read():
    a = CachingAllocator(capacity_bytes=30 * MiB)
    a.malloc(25 * MiB)
    with pytest.raises(SimulatedOutOfMemoryError) as err:
        a.malloc(25 * MiB)
    m = O.parse_oom_message(str(err.value))
    assert m.simulated and m.tried.bytes == 26 * MiB and _close(m.allocated, 26 * MiB)


# ---- malformed text: a clear "could not read this message", never another exception ------------------

@pytest.mark.parametrize("bad, words", [
    ("", "it is empty"),
    ("   \n\t ", "it is empty"),
    (None, "expected text"),
    (12, "expected text"),
    (b"CUDA out of memory", "expected text"),
    ("RuntimeError: CUDA error: device-side assert triggered", "does not say 'CUDA out of memory'"),
    ("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes.", "the CPU's"),
    ("CUDA out of memory. Tried to allocate more than 1EB memory.", "absurd"),
    ("CUDA out of memory. Tried to allocate 12.50 MiB", "not in a format gpulab knows"),
    ("CUDA out of memory. Tried to allocate 12.50 MB. GPU 0 has a total capacity of 15.00 GB of which 1 GB is free.",
     "not in a format gpulab knows"),
    ("CUDA out of memory. Allocation was preemptively rejected because it would exceed per_process_memory_fraction "
     "limit. Requested size: 2.00 GiB", "set_per_process_memory_fraction"),
])
def test_malformed_messages(bad, words):
    with pytest.raises(O.OOMParseError, match="could not read this message") as err:
        O.parse_oom_message(bad)
    assert words in str(err.value)
    assert isinstance(err.value, ValueError)


def test_no_mangled_message_raises_anything_else():
    text = CURRENT_EXPECTED
    rng = random.Random(0)
    samples = [text[:i] for i in range(0, len(text), 5)] + [text[i:] for i in range(0, len(text), 9)]
    for _ in range(200):
        chars = list(text)
        for _ in range(rng.randint(1, 6)):
            chars[rng.randrange(len(chars))] = rng.choice(string.printable)
        samples.append("".join(chars))
    samples += ["".join(rng.choice(string.printable) for _ in range(rng.randint(0, 300))) for _ in range(100)]
    read = 0
    for s in samples:
        try:
            d = O.diagnose(s)
        except O.OOMParseError as exc:
            assert str(exc).startswith("could not read this message")
        else:
            read += 1
            assert d.case in O.CASES
    assert read > 0
