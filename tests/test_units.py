"""gpulab.units against torch itself and against hand-checked numbers."""
import warnings

import pytest
import torch

from gpulab import units
from gpulab.units import DTYPES, dtype_bytes, dtype_name, format_bytes, parse_dtype, round_up


def _real_tensor(dtype: torch.dtype, n: int) -> torch.Tensor:
    """A real n-element tensor of ``dtype`` (quantized dtypes need a quantizer)."""
    if dtype in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4):
        return torch.quantize_per_tensor(torch.zeros(n), 1.0, 0, dtype)
    return torch.empty(n, dtype=dtype)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_size_matches_torch(name):
    info = DTYPES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 / quantized creation warn
        t = _real_tensor(info.dtype, 16)
    assert info.bytes == t.element_size() == info.dtype.itemsize
    assert info.bits == 8 * t.element_size()
    # the storage really holds numel x bytes: packed sub-byte dtypes must not be listed
    assert t.untyped_storage().nbytes() == 16 * info.bytes
    assert dtype_bytes(name) == info.bytes
    assert parse_dtype(name) is info.dtype


def test_empty_zero_element_size_for_plain_dtypes():
    for name, info in DTYPES.items():
        if info.kind == "quantized":
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert torch.empty(0, dtype=info.dtype).element_size() == info.bytes, name


# A hand-written table (from the dtype documentation), independent of torch.dtype.itemsize.
KNOWN_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "complex128": 16, "complex64": 8, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint8": 1, "bool": 1, "qint8": 1, "quint8": 1, "qint32": 4,
}


@pytest.mark.parametrize("name,nbytes", sorted(KNOWN_BYTES.items()))
def test_known_sizes(name, nbytes):
    assert DTYPES[name].bytes == nbytes


def test_packed_subbyte_dtypes_are_not_listed():
    for name in ("uint4", "int4", "uint1", "bits8", "float4_e2m1fn_x2", "quint4x2", "quint2x4"):
        assert name not in DTYPES


def test_kinds():
    assert DTYPES["float32"].kind == "float"
    assert DTYPES["bfloat16"].kind == "float"
    assert DTYPES["float8_e4m3fn"].kind == "float8"
    assert DTYPES["complex64"].kind == "complex"
    assert DTYPES["int8"].kind == "int"
    assert DTYPES["uint8"].kind == "uint"
    assert DTYPES["bool"].kind == "bool"
    assert DTYPES["qint8"].kind == "quantized"


@pytest.mark.parametrize("text,dtype", [
    ("fp32", torch.float32), ("float", torch.float32), ("float32", torch.float32),
    ("torch.float32", torch.float32), ("  FP16 ", torch.float16), ("half", torch.float16),
    ("bf16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16), ("fp64", torch.float64),
    ("double", torch.float64), ("fp8", torch.float8_e4m3fn), ("e4m3", torch.float8_e4m3fn),
    ("e5m2", torch.float8_e5m2), ("long", torch.int64), ("int", torch.int32),
    ("short", torch.int16), ("cfloat", torch.complex64), ("cdouble", torch.complex128),
    ("bool", torch.bool), ("uint8", torch.uint8),
])
def test_parse_dtype_aliases(text, dtype):
    assert parse_dtype(text) is dtype


def test_parse_dtype_passes_dtypes_through():
    assert parse_dtype(torch.bfloat16) is torch.bfloat16


@pytest.mark.parametrize("bad", ["fp17", "float33", "", "torch.tensor"])
def test_parse_dtype_error_names_valid_dtypes(bad):
    with pytest.raises(ValueError) as e:
        parse_dtype(bad)
    msg = str(e.value)
    assert repr(bad) in msg
    assert "valid dtypes" in msg
    for name in ("float32", "bfloat16", "float16", "int8", "fp16", "bf16"):
        assert name in msg
    assert "\n" not in msg  # one line, so the CLI can print it as one line


def test_dtype_name_and_bytes():
    assert dtype_name(torch.float16) == "float16"
    assert dtype_bytes("bf16") == 2
    assert dtype_bytes(torch.float64) == 8


@pytest.mark.parametrize("nbytes,binary,decimal", [
    (3_000_000, "2.9 MiB", "3.0 MB"),           # the reference articles' 500x500x3 fp32 image
    (30_720_000, "29.3 MiB", "30.7 MB"),        # (256, 3, 100, 100) fp32
    (0, "0 B", "0 B"),
    (512, "512 B", "512 B"),
    (999, "999 B", "999 B"),
    (1000, "1000 B", "1.0 KB"),
    (1024, "1.0 KiB", "1.0 KB"),
    (3 * 2**20, "3.0 MiB", "3.1 MB"),
    (2**30, "1.0 GiB", "1.1 GB"),
    (10**9, "953.7 MiB", "1.0 GB"),
    (80 * 2**30, "80.0 GiB", "85.9 GB"),
    (-2048, "-2.0 KiB", "-2.0 KB"),
])
def test_format_bytes_binary_and_decimal(nbytes, binary, decimal):
    assert format_bytes(nbytes) == binary
    assert format_bytes(nbytes, "binary") == binary
    assert format_bytes(nbytes, system="decimal") == decimal


@pytest.mark.parametrize("nbytes,binary,decimal", [
    (2**20 - 1, "1.0 MiB", "1.0 MB"),            # not "1024.0 KiB"
    (2**30 - 1, "1.0 GiB", "1.1 GB"),
    (999_999, "976.6 KiB", "1.0 MB"),            # not "1000.0 KB"
    (999_999_999, "953.7 MiB", "1.0 GB"),
    (1023 * 1024, "1023.0 KiB", "1.0 MB"),
    (3 * 2**40, "3072.0 GiB", "3298.5 GB"),       # GiB / GB are the largest units
])
def test_format_bytes_never_prints_a_full_step_of_a_unit(nbytes, binary, decimal):
    assert format_bytes(nbytes) == binary
    assert format_bytes(nbytes, "decimal") == decimal
    assert format_bytes(2**20 - 1, digits=3) == "1023.999 KiB"


def test_format_bytes_digits_and_errors():
    assert format_bytes(3_000_000, digits=3) == "2.861 MiB"
    assert format_bytes(3_000_000, "decimal", digits=0) == "3 MB"
    with pytest.raises(ValueError, match="binary.*decimal"):
        format_bytes(1, system="metric")


def test_unit_constants_and_helpers():
    assert (units.KiB, units.MiB, units.GiB) == (1024, 1024**2, 1024**3)
    assert (units.KB, units.MB, units.GB) == (1000, 1000**2, 1000**3)
    assert units.mib(3 * 2**20) == 3.0
    assert [round_up(n, 512) for n in (0, 1, 511, 512, 513, 1024)] == [0, 512, 512, 512, 1024, 1024]
