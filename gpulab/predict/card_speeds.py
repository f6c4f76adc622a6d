"""How fast each card computes and moves bytes: the facts a step-time prediction reads
(``predict.timing``), one row per card of ``predict.cards``, each with its source.

Dense peak FLOP/s per dtype and the memory bandwidth, as the vendor's datasheet prints them.
NVIDIA's Hopper, Ampere-sparsity and Ada datasheets print Tensor Core figures *with 2:4 sparsity*
(marked "*"; "specifications 1/2 lower without sparsity"): the dense figure kept here is half of
it, and the row's ``source`` says so. A dtype a card has no figure for is ``None`` ("no figure":
a T4 has no TF32/BF16/FP8 Tensor Cores, an A100 no FP8), and a card without a row has no figures
at all (``speed_of`` refuses it, naming the cards that have some). Nothing is fetched at runtime.

A measured card (this CPU) comes from ``measure.cpu_speed`` (``cpu_card_speed``): its peak is a
matmul's rate measured on the spot, and its assumptions say so.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpulab.measure.cpu_speed import CpuSpeed
from gpulab.predict.cards import Card, as_card

__all__ = ["CARD_SPEEDS", "DTYPE_KEYS", "LAUNCH_OVERHEAD_SOURCE", "CardSpeed", "Links", "TimeAssumptions",
           "cpu_card_speed", "speed_of"]

# the dtypes a peak is given for, in the order a table shows them
DTYPE_KEYS = ("fp32", "tf32", "bf16", "fp16", "fp8")

LAUNCH_OVERHEAD_SOURCE = ("torch/_inductor/scheduler.py, _REINDEXING_FUSION_LAUNCH_OVERHEAD_NS = 1_000: the "
                          "launch cost inductor's fusion cost model charges per kernel")
EFFICIENCY_SOURCE = ("PyTorch's RuntimeEstimator roofline (torch/utils/_runtime_estimation.py, flops_to_ns: "
                     "'Uses 75% of theoretical peak'; get_transfer_time: the full datasheet bandwidth)")


@dataclass(frozen=True)
class TimeAssumptions:
    """What a roofline cannot know, as named values shown with every answer, never tuned silently.

    An op's time is max(FLOPs / (peak[dtype] × compute_efficiency), bytes / (bandwidth ×
    memory_efficiency)) + launch_overhead_s. The defaults: ``EFFICIENCY_SOURCE`` for the two
    efficiencies, ``LAUNCH_OVERHEAD_SOURCE`` for the launch cost."""
    compute_efficiency: float = 0.75
    memory_efficiency: float = 1.0
    launch_overhead_s: float = 1e-6
    source: str = f"efficiencies: {EFFICIENCY_SOURCE}; launch overhead: {LAUNCH_OVERHEAD_SOURCE}"

    def __post_init__(self) -> None:
        for name in ("compute_efficiency", "memory_efficiency"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")
        if self.launch_overhead_s < 0:
            raise ValueError(f"launch_overhead_s must be >= 0, got {self.launch_overhead_s!r}")

    @property
    def text(self) -> str:
        return (f"compute efficiency {self.compute_efficiency:g}, memory efficiency {self.memory_efficiency:g}, "
                f"launch overhead {self.launch_overhead_s * 1e6:g} µs per kernel")


@dataclass(frozen=True)
class Links:
    """How fast one GPU of this card moves bytes off the chip, each figure per direction in GB/s
    (decimal), the way NCCL's bus bandwidth is measured ("The measurement is of a unidirectional
    bandwidth": nccl-tests doc/PERFORMANCE.md): ``nvlink_gbs`` to the other GPUs of its node (None:
    no NVLink, the GPUs talk over PCIe), ``network_gbs`` to other nodes (None: no figure),
    ``host_gbs`` to host memory over PCIe; ``gpus_per_node`` GPUs share a node. Datasheets print
    NVLink and PCIe bidirectional: the figure here is half, and ``source`` says so."""
    host_gbs: float
    nvlink_gbs: float | None = None
    network_gbs: float | None = None
    gpus_per_node: int = 8
    source: str = ""

    @property
    def node_gbs(self) -> float:
        """GPU to GPU inside a node: NVLink, or PCIe where the card has none."""
        return self.nvlink_gbs if self.nvlink_gbs is not None else self.host_gbs


_HALVED = "bidirectional figures halved: one direction"
_DGX_H100 = ("NVIDIA DGX H100 datasheet, https://resources.nvidia.com/en-us-dgx-systems/ai-enterprise-dgx "
             "(8 GPUs; 8x ConnectX-7 400 Gb/s InfiniBand/Ethernet: 50 GB/s a GPU)")
_DGX_A100 = ("NVIDIA DGX A100 datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/nvidia-"
             "dgx-a100-datasheet.pdf (8 GPUs; 8x ConnectX-6 200 Gb/s HDR InfiniBand: 25 GB/s a GPU)")
_PCIE4 = "PCIe Gen4 x16: 64 GB/s bidirectional (PCI-SIG 4.0: 16 GT/s a lane)"
_NO_NET = "no network figure: gpulab predicts no time across nodes for this card"


@dataclass(frozen=True)
class CardSpeed:
    """One card's speeds: dense peak TFLOP/s per dtype (``DTYPE_KEYS``; None: no figure), memory
    bandwidth in GB/s (decimal, as datasheets print it), where they come from, and the assumptions
    a prediction for it uses."""
    name: str
    peak_tflops: dict[str, float | None]
    bandwidth_gbs: float
    source: str
    note: str = ""
    assumptions: TimeAssumptions = field(default_factory=TimeAssumptions)
    links: Links | None = None   # None: no link figures (this CPU)

    def peak_flops(self, dtype_key: str) -> float:
        """FLOP/s for ``dtype_key``; a dtype without a figure raises ``ValueError`` naming the card."""
        tflops = self.peak_tflops.get(dtype_key)
        if tflops is None:
            have = ", ".join(k for k in DTYPE_KEYS if self.peak_tflops.get(k) is not None)
            raise ValueError(f"{self.name} has no {dtype_key} peak in gpulab's card table ({self.source}); "
                             f"it has figures for {have or 'no dtype'}: run in one of those dtypes")
        return tflops * 1e12

    @property
    def bandwidth_bytes_s(self) -> float:
        return self.bandwidth_gbs * 1e9


def _sparse_halved(fp32: float, tf32: float | None, bf16: float | None, fp8: float | None) -> dict[str, float | None]:
    """A datasheet's figures where the Tensor Core ones are printed with sparsity: dense = half."""
    half = (lambda v: None if v is None else v / 2)
    return {"fp32": fp32, "tf32": half(tf32), "bf16": half(bf16), "fp16": half(bf16), "fp8": half(fp8)}


_H100_SHEET = "NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/"
_H200_SHEET = "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/"
_A100_SHEET = ("NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/"
               "Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_SPARSE = "Tensor Core figures printed with sparsity, halved here for dense"

# One row per card: (name in predict.cards, peaks, bandwidth GB/s, source, note)
CARD_SPEEDS: dict[str, CardSpeed] = {s.name: s for s in (
    CardSpeed("H100", _sparse_halved(67, 989, 1979, 3958), 3350,
              f"{_H100_SHEET} (H100 SXM column: FP32 67, TF32 989*, BF16/FP16 1,979*, FP8 3,958* TFLOPS, "
              f"3.35 TB/s; {_SPARSE})",
              "H100 SXM5's figures; the PCIe card gpulab also calls 'H100' is slower (datasheet PCIe column: "
              "FP32 51, BF16 1,513* TFLOPS, 2 TB/s)",
              links=Links(64, 450, 50, 8, f"{_H100_SHEET} (SXM: NVLink 900 GB/s, PCIe Gen5 128 GB/s; {_HALVED}); {_DGX_H100}")),
    CardSpeed("H200", _sparse_halved(67, 989, 1979, 3958), 4800,
              f"{_H200_SHEET} (H200 SXM column: FP32 67, TF32 989*, BF16/FP16 1,979*, FP8 3,958* TFLOPS, "
              f"4.8 TB/s; {_SPARSE})", "H200 SXM's figures (the NVL card is slower)",
              links=Links(64, 450, 50, 8, f"{_H200_SHEET} (SXM: NVLink 900 GB/s, PCIe Gen5 128 GB/s; {_HALVED}); network as {_DGX_H100}")),
    CardSpeed("A100-40GB", {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312, "fp8": None}, 1555,
              f"{_A100_SHEET} (A100 40GB SXM column: FP32 19.5, TF32 156, BF16/FP16 312 TFLOPS dense, "
              f"1,555 GB/s)", "Ampere has no FP8 Tensor Cores: no fp8 figure",
              links=Links(32, 300, 25, 8, f"{_A100_SHEET} (SXM: NVLink 600 GB/s, PCIe Gen4 64 GB/s; {_HALVED}); {_DGX_A100}")),
    CardSpeed("A100-80GB", {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312, "fp8": None}, 2039,
              f"{_A100_SHEET} (A100 80GB SXM column: FP32 19.5, TF32 156, BF16/FP16 312 TFLOPS dense, "
              f"2,039 GB/s)", "the 80GB PCIe card has 1,935 GB/s; Ampere has no FP8 Tensor Cores: no fp8 figure",
              links=Links(32, 300, 25, 8, f"{_A100_SHEET} (SXM: NVLink 600 GB/s, PCIe Gen4 64 GB/s; {_HALVED}); {_DGX_A100}")),
    CardSpeed("L4", _sparse_halved(30.3, 120, 242, 485), 300,
              "NVIDIA L4 Tensor Core GPU datasheet, https://resources.nvidia.com/en-us-gpu-resources/"
              f"l4-tensor-datasheet (FP32 30.3, TF32 120*, BF16/FP16 242*, FP8 485* TFLOPS, 300 GB/s; {_SPARSE})",
              links=Links(32, None, None, 8, f"L4 datasheet: PCIe Gen4 x16 64 GB/s, no NVLink ({_HALVED}); {_NO_NET}")),
    CardSpeed("T4", {"fp32": 8.1, "tf32": None, "bf16": None, "fp16": 65, "fp8": None}, 320,
              "NVIDIA T4 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/"
              "Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf (single precision 8.1 TFLOPS, mixed "
              "precision FP16/FP32 65 TFLOPS, 320 GB/s)",
              "Turing has no TF32, BF16 or FP8 Tensor Cores: no figures for them",
              links=Links(16, None, None, 8, "T4 datasheet: PCIe Gen3 x16 32 GB/s bidirectional, no NVLink "
                                             f"({_HALVED}); {_NO_NET}")),
    CardSpeed("RTX 4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3}, 1008,
              "NVIDIA Ada GPU Architecture whitepaper, Appendix A (GeForce RTX 4090 column), https://images.nvidia."
              "com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf (FP32 82.6; dense Tensor TFLOPS "
              "with FP32 accumulate: TF32 82.6, BF16/FP16 165.2, FP8 330.3; 1,008 GB/s)",
              "with FP32 accumulate, as PyTorch's matmuls accumulate; GeForce runs FP16-accumulate at twice that",
              links=Links(32, None, None, 8, f"Ada whitepaper: {_PCIE4}, no NVLink on GeForce RTX 4090 ({_HALVED}); "
                                             f"{_NO_NET}")),
)}


def speed_of(gpu: Any) -> CardSpeed:
    """The speed row of a card (a name ``--gpu`` accepts, or a ``Card``); a card without one raises
    ``ValueError`` naming the cards that have one."""
    if isinstance(gpu, CardSpeed):
        return gpu
    card: Card = as_card(gpu)
    if card.name not in CARD_SPEEDS:
        raise ValueError(f"gpulab has no speed figures for {card.name} (its card table gives them for "
                         f"{', '.join(CARD_SPEEDS)}): time is predicted only for those cards")
    return CARD_SPEEDS[card.name]


def cpu_card_speed(measured: CpuSpeed) -> CardSpeed:
    """This CPU as a card: its fp32 peak and bandwidth measured (``measure.cpu_speed``), so the
    efficiencies are 1 (the peak is already an achieved rate) and the launch cost is the measured
    per-op overhead of eager PyTorch."""
    return CardSpeed("this CPU", {"fp32": measured.fp32_flops / 1e12}, measured.bytes_per_s / 1e9,
                     f"measured here: {measured.text}",
                     assumptions=TimeAssumptions(1.0, 1.0, measured.op_overhead_s,
                                                 source=f"measured here: {measured.text}"))
