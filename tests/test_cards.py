"""gpulab.predict.cards: the card table and the ``--gpu`` parser, against hand-checked numbers."""
import pytest

from gpulab.predict.cards import CARDS, Card, card_names, parse_gpu
from gpulab.course.sweeps import CARDS_GIB
from gpulab.units import GB, GiB, KiB, MiB


def _variants(spelling: str) -> set[str]:
    """The same spelling as a student might type it: other case, other separators, none."""
    joined = spelling.replace("-", "").replace(" ", "")
    return {spelling, spelling.lower(), spelling.upper(), joined, joined.lower(),
            spelling.replace("-", " "), spelling.replace(" ", "-")}


@pytest.mark.parametrize("card", CARDS, ids=lambda c: c.name)
def test_every_name_and_alias_parses_to_its_card(card):
    for spelling in (card.name, *card.aliases):
        for typed in _variants(spelling):
            assert parse_gpu(typed) is card, typed


def test_table_convention_vendor_gb_is_gib():
    sizes = {c.name: c.memory_bytes for c in CARDS}
    assert sizes["H100"] == 80 * GiB
    assert sizes["H200"] == 141 * GiB
    assert sizes["A100-40GB"] == 40 * GiB and sizes["A100-80GB"] == 80 * GiB
    assert sizes["L4"] == sizes["A10"] == sizes["A10G"] == 24 * GiB
    assert sizes["L40S"] == 48 * GiB
    assert sizes["T4"] == sizes["V100-16GB"] == 16 * GiB and sizes["V100-32GB"] == 32 * GiB
    assert sizes["RTX 3090"] == sizes["RTX 4090"] == 24 * GiB
    assert sizes["RTX 4080"] == 16 * GiB
    assert sizes["RTX 4070"] == sizes["RTX 3060"] == 12 * GiB
    assert sizes["RTX 5090"] == 32 * GiB
    assert sizes["MI300X"] == 192 * GiB
    assert sizes["B200"] == 180 * GiB
    assert len(sizes) == len(CARDS) == 19  # names are unique (B200 added with the compute capabilities)
    for c in CARDS:
        assert isinstance(c, Card) and c.memory_bytes % GiB == 0
        assert f"counted here as {c.memory_bytes // GiB} GiB" in c.note
    # the sweep's card sizes are all card sizes of this table (8 GiB: the small RTX 3060)
    assert {s for s in CARDS_GIB if s != 8} <= {c.memory_bytes // GiB for c in CARDS}


def test_card_names_in_table_order():
    names = card_names()
    assert names == [c.name for c in CARDS]
    assert names[:3] == ["H100", "H200", "A100-40GB"]


@pytest.mark.parametrize("typed, name", [
    ("H100", "H100"), ("h100-80gb", "H100"), ("NVIDIA H100 80GB HBM3", "H100"),
    ("A100-40GB", "A100-40GB"), ("a100 40gb", "A100-40GB"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("RTX4090", "RTX 4090"), ("4090", "RTX 4090"), ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ("Tesla T4", "T4"), ("  l40s ", "L40S"), ("AMD Instinct MI300X", "MI300X"),
])
def test_spellings_from_the_brief_and_from_device_names(typed, name):
    assert parse_gpu(typed).name == name


@pytest.mark.parametrize("typed, nbytes, name", [
    ("24GiB", 24 * GiB, "24 GiB"), ("24 GiB", 24 * GiB, "24 GiB"), ("80gib", 80 * GiB, "80 GiB"),
    ("1.5TiB", 3 * 2**39, "1.5 TiB"), ("512MiB", 512 * MiB, "512 MiB"),
    ("64KiB", 64 * KiB, "64 KiB"), ("16G", 16 * GiB, "16 GiB"), ("16g", 16 * GiB, "16 GiB"),
    ("512M", 512 * MiB, "512 MiB"), ("24GB", 24 * GB, "24 GB"), ("24 gb", 24_000_000_000, "24 GB"),
    ("500MB", 500_000_000, "500 MB"), ("2TB", 2 * 10**12, "2 TB"), ("8KB", 8000, "8 KB"),
    ("0.5GiB", 512 * MiB, "0.5 GiB"),
])
def test_sizes_with_each_unit(typed, nbytes, name):
    card = parse_gpu(typed)
    assert card.memory_bytes == nbytes
    assert card.name == name
    assert card.aliases == ()
    assert f"{nbytes:,} bytes" in card.note


def test_decimal_gb_is_stated_in_the_note():
    card = parse_gpu("24GB")
    assert card.memory_bytes == 24_000_000_000
    assert "24 GB = 24,000,000,000 bytes (decimal)" in card.note
    assert "22.4 GiB" in card.note


def test_bare_g_is_binary_and_says_so():
    assert "a bare G is read as GiB" in parse_gpu("16G").note
    assert "(binary)" in parse_gpu("24GiB").note


@pytest.mark.parametrize("bad", ["", "fast", "24", "-3GiB", "H1000", "0GiB", "24 parsecs",
                                 "A100", "v100", "3.5", "GiB"])
def test_bad_inputs_give_one_line_message_with_the_accepted_forms(bad):
    with pytest.raises(ValueError) as info:
        parse_gpu(bad)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"cannot read --gpu {bad!r}:")
    assert "give a size such as 24GiB, 80GB or 512MiB" in msg
    assert "or a card: " + ", ".join(card_names()) in msg


def test_bad_inputs_say_what_is_wrong():
    assert "needs a unit" in str(pytest.raises(ValueError, parse_gpu, "24").value)
    assert "at least 1 byte" in str(pytest.raises(ValueError, parse_gpu, "-3GiB").value)
    assert "at least 1 byte" in str(pytest.raises(ValueError, parse_gpu, "0GiB").value)
    assert "(did you mean H100?)" in str(pytest.raises(ValueError, parse_gpu, "H1000").value)
    msg = str(pytest.raises(ValueError, parse_gpu, "A100").value)
    assert "did you mean A100-40GB or A100-80GB?" in msg
    assert "unknown unit 'parsecs'" in str(pytest.raises(ValueError, parse_gpu, "24 parsecs").value)


def test_every_nvidia_card_carries_its_compute_capability():
    """NVIDIA's compute capabilities (its CUDA GPUs list; the H200 recorded here reported 9.0): they decide
    the attention kernel and the cuBLAS workspace a question about the card follows."""
    cc = {c.name: c.capability for c in CARDS}
    assert cc["T4"] == (7, 5) and cc["V100-16GB"] == cc["V100-32GB"] == (7, 0)
    assert cc["A100-40GB"] == cc["A100-80GB"] == (8, 0)
    assert cc["A10"] == cc["A10G"] == cc["RTX 3090"] == cc["RTX 3060"] == (8, 6)
    assert cc["L4"] == cc["L40S"] == cc["RTX 4090"] == cc["RTX 4080"] == cc["RTX 4070"] == (8, 9)
    assert cc["H100"] == cc["H200"] == (9, 0) and cc["B200"] == (10, 0) and cc["RTX 5090"] == (12, 0)
    assert cc["MI300X"] is None     # not a CUDA card: its questions say sm80 rules were assumed
    assert parse_gpu("T4").kernel_target.text == "a T4 (sm75)"
    assert "no compute capability known for 24 GiB" in parse_gpu("24GiB").kernel_target.text


def test_a_python_caller_is_not_told_about_a_command_line_flag():
    """Issue 47: from Python (lesson 14's CARD = "T5") the message names the card, not --gpu, and a
    one-character slip in a short name still gets its guess."""
    msg = str(pytest.raises(ValueError, parse_gpu, "T5", "card").value)
    assert msg.startswith("cannot read card 'T5':") and "--gpu" not in msg
    assert "(did you mean T4?)" in msg
    assert "(did you mean L4?)" in str(pytest.raises(ValueError, parse_gpu, "L5").value)
    assert "did you mean" not in str(pytest.raises(ValueError, parse_gpu, "fast").value)


def test_a_python_call_with_a_mistyped_card_names_its_argument_not_the_flag():
    from gpulab.predict.cards import as_card
    with pytest.raises(ValueError) as info:
        as_card("T5")
    text = str(info.value)
    assert text.startswith("cannot read gpu 'T5'") and "--gpu" not in text and "did you mean T4?" in text, text
