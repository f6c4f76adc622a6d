"""The training levers in gpulab.formulas (ZeRO, 8-bit optimizer state, LoRA, NF4,
activation checkpointing) against the numbers their papers and code state."""
import pytest

from gpulab import formulas as F

PSI, N, K = 7_500_000_000, 64, 12


# --- ZeRO ----------------------------------------------------------------------------------

@pytest.mark.parametrize("stage, gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_reproduces_figure_1(stage, gb):
    """Rajbhandari et al. 2019 (arXiv 1910.02054), figure 1: Psi = 7.5B, N = 64, K = 12."""
    nbytes = F.zero_bytes_per_device(PSI, N, stage, optimizer_bytes_per_param=K)
    assert round(nbytes / 1e9, 1) == gb


def test_zero_exact_bytes_and_general_sizes():
    assert F.zero_bytes_per_device(PSI, N, 0) == 16 * PSI
    assert F.zero_bytes_per_device(PSI, N, 1) == 4 * PSI + 12 * PSI // 64
    assert F.zero_bytes_per_device(PSI, N, 2) == 2 * PSI + 14 * PSI // 64
    assert F.zero_bytes_per_device(PSI, N, 3) == 16 * PSI // 64
    # one device: every stage is plain data parallelism
    assert {F.zero_bytes_per_device(1000, 1, s) for s in range(4)} == {16_000}
    # fp32 params and grads with Adam's 8 B of state: 4 + 4 + 8 = 16 B, shared by 4 devices
    assert F.zero_bytes_per_device(1000, 4, 3, 4, 4, 8) == 4000
    # a shard is ceil(Psi / N) elements
    assert F.zero_bytes_per_device(10, 4, 3) == 16 * 3


def test_zero_rejects_bad_arguments():
    with pytest.raises(ValueError):
        F.zero_bytes_per_device(PSI, N, 4)
    with pytest.raises(ValueError):
        F.zero_bytes_per_device(PSI, 0, 1)


# --- 8-bit optimizer state -------------------------------------------------------------------

def test_eight_bit_state_worked_example():
    # a 4096 x 4096 weight with 8-bit Adam: 2 states x (16,777,216 B + 65,536 blocks x 4 B)
    n = 4096 * 4096
    assert F.eight_bit_optimizer_state_bytes(n) == 2 * (n + 4 * (n // 256)) == 34_078_720
    # against torch Adam's 8 B per element: about 3.9x smaller
    assert 8 * n / F.eight_bit_optimizer_state_bytes(n) == pytest.approx(3.94, abs=0.01)


def test_eight_bit_state_partial_block_and_one_state():
    assert F.eight_bit_optimizer_state_bytes(257, states=1) == 257 + 2 * 4
    assert F.eight_bit_optimizer_state_bytes(2048, block_size=2048) == 2 * (2048 + 4)
    assert F.eight_bit_optimizer_state_bytes(0) == 0


# --- LoRA ------------------------------------------------------------------------------------

def test_lora_q_proj_rank_8():
    assert F.lora_params(4096, 4096, 8) == 65_536


def test_lora_trainable_params_sums_layers():
    # rank 16 on q_proj and v_proj of a 32-layer model with hidden 4096 and 1024-wide v_proj
    shapes = [(4096, 4096), (4096, 1024)] * 32
    assert F.lora_trainable_params(shapes, 16) == 32 * (16 * 8192 + 16 * 5120) == 6_815_744
    assert F.lora_trainable_params([], 8) == 0


# --- NF4 -------------------------------------------------------------------------------------

def test_nf4_constants_match_qlora_bits_per_param():
    """QLoRA (arXiv 2305.14314), section 3: 32/64 = 0.5 bits per parameter of constants,
    0.127 with double quantization."""
    n = 10**9
    plain = F.nf4_weight_bytes(n, double_quant=False)
    dq = F.nf4_weight_bytes(n, double_quant=True)
    assert plain * 8 / n - 4 == pytest.approx(0.5)
    assert round(dq * 8 / n - 4, 3) == 0.127
    # saving 0.373 bits per parameter, about 3 GB on a 65B model
    assert (plain - dq) * 65 == pytest.approx(3.03e9, rel=0.01)


def test_nf4_bytes_per_param():
    assert F.nf4_weight_bytes(64, double_quant=False) == 0.5 * 64 + 4
    assert F.nf4_weight_bytes(64 * 256, double_quant=True) == 0.5 * 64 * 256 + 256 + 4


# --- activation checkpointing ----------------------------------------------------------------

def test_checkpointed_activations():
    # 24 layers, 100 MiB of activations each, 8 MiB layer input: 24 x 8 + 100 MiB
    mib = 2**20
    assert F.checkpointed_activation_bytes(100 * mib, 24, 8 * mib) == 292 * mib
    assert F.checkpointed_activation_bytes(100 * mib, 24, 8 * mib) < 24 * 100 * mib
    assert F.checkpointed_activation_bytes(100, 0, 8) == 0
