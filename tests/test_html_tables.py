"""Issue 47: lesson 14's largest-batch table showed `&#x27;` and `&gt;` as text (its cells were escaped
twice: by the view and again by html_table) and its bytes column wrapped every value onto two lines."""
import re

import transformers

from gpulab.course.capstone import largest_batch, your_model
from gpulab.tables import html_table

DOUBLE = re.compile(r"&amp;(#x?[0-9a-fA-F]+|[a-z]+);")


def test_html_table_escapes_once_and_keeps_short_cells_on_one_line():
    h = html_table(["a", "b"], [["it's > 1", "12.3 MiB"], ["x" * 80, "1,234.5 GiB"], ["foreach", "7"]], "the 'caption' > 0")
    assert "it&#x27;s &gt; 1" in h and "the &#x27;caption&#x27; &gt; 0" in h
    assert not DOUBLE.search(h)
    assert "white-space:nowrap" in h
    assert "<td class='gpulab-nw'>12.3 MiB</td>" in h and "<td class='gpulab-nw'>1,234.5 GiB</td>" in h
    assert "<td>" + "x" * 80 + "</td>" in h and "<td>foreach</td><td>7</td>" in h   # words wrap as before


def test_lesson_14s_largest_batch_table_has_no_double_escaped_entity_and_no_wrapping_bytes():
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=512, n_positions=128,
                                     bos_token_id=0, eos_token_id=0)
    h = largest_batch(your_model(config, "T4", seq_len=128))._repr_html_()
    assert not DOUBLE.search(h), DOUBLE.findall(h)
    cells = re.findall(r"<td( class='gpulab-nw')?>([^<]*)</td>", h)
    sizes = [(cls, text) for cls, text in cells if re.fullmatch(r"-?[\d,.]+ (B|KiB|MiB|GiB|TiB)", text)]
    assert sizes and all(cls for cls, _ in sizes), sizes
