"""Building a transformers model after ``import gpulab`` logs nothing about library versions.

transformers imports torchao whenever it is installed (a gpulab dependency for FP8 training), and
torch's pytree logs a deprecation notice for each Enum torchao registers. A lesson cell would show
it on a kernel's first Run All and not on the second, which the robustness test rightly counts as
a difference. gpulab drops that one notice (gpulab/__init__.py); this test fails if it comes back,
in a fresh process, since the notice is logged once per process."""
from __future__ import annotations

import subprocess
import sys


SCRIPT = """
import gpulab, torch, transformers
cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2)
with torch.device("meta"):
    transformers.LlamaForCausalLM(cfg)
import transformers.quantizers    # what imports torchao, where it is installed
print("built")
"""


def test_no_version_notice_when_a_transformers_model_is_built():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "built" in out.stdout
    assert "register_constant" not in out.stderr, out.stderr[-2000:]


def test_other_pytree_records_still_pass():
    import logging

    import gpulab  # noqa: F401  (installs the filter)
    record = logging.LogRecord("torch.utils._pytree", logging.WARNING, __file__, 1, "something else", None, None)
    assert logging.getLogger("torch.utils._pytree").filter(record)
