"""Device facts from NVML (what nvidia-smi reads) and torch.cuda. Never raises: without a
GPU or without NVML the facts say so in ``reason``."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

__all__ = [
    "DeviceReport", "GpuFacts", "allocator_segments", "device_report", "gpu_name",
    "nvml_used_bytes", "nvml_used_bytes_at", "pci_bus_id"
]


@dataclass
class GpuFacts:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    used_bytes: int          # NVML: device-wide used memory, what nvidia-smi shows
    driver: str
    compute_capability: str
    source: str              # "nvml" or "torch.cuda"


@dataclass
class DeviceReport:
    cuda_available: bool
    gpus: list[GpuFacts] = field(default_factory=list)
    nvml_available: bool = False
    reason: str = ""         # why there is no GPU / no NVML, in plain words

    def as_dict(self) -> dict:
        return {"cuda_available": self.cuda_available, "nvml_available": self.nvml_available,
                "reason": self.reason, "gpus": [asdict(g) for g in self.gpus]}


def _nvml():
    """The pynvml module, initialised, or (None, reason)."""
    try:
        import pynvml  # provided by the nvidia-ml-py package
    except ImportError:
        return None, "the pynvml module (package nvidia-ml-py) is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None, f"NVML could not start ({exc}): no NVIDIA driver on this machine"
    return pynvml, ""


def nvml_used_bytes(cuda_index: int = 0) -> int | None:
    """Device-wide used memory from NVML (all processes, CUDA context included: what
    nvidia-smi shows) of CUDA device ``cuda_index``, or None.

    NVML numbers devices in PCI bus order; CUDA numbers them fastest first by default
    (CUDA_DEVICE_ORDER) and only those CUDA_VISIBLE_DEVICES lets through. The two numberings
    need not agree, so the CUDA device is found in NVML by its PCI bus id, never by index."""
    nv, _ = _nvml()
    if nv is None:
        return None
    try:
        handle = nv.nvmlDeviceGetHandleByPciBusId(pci_bus_id(cuda_index))
        return int(nv.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:
        return None


def nvml_used_bytes_at(nvml_index: int) -> int | None:
    """Used memory of NVML's device ``nvml_index`` (nvidia-smi's ``-i`` numbering), or None."""
    nv, _ = _nvml()
    if nv is None:
        return None
    try:
        return int(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(nvml_index)).used)
    except Exception:
        return None


def allocator_segments(device: torch.device | int = 0) -> list[tuple[str, tuple[tuple[int, bool], ...]]] | None:
    """The caching allocator's segments on ``device`` now, from ``torch.cuda.memory_snapshot()``:
    each its pool ("small" / "large") and its blocks in address order, (size, allocated) (the
    form ``allocator.rebuilt_allocator`` takes). None when the snapshot is not available or its
    allocated blocks do not add up to ``memory_allocated``."""
    index = device.index if isinstance(device, torch.device) else device
    index = torch.cuda.current_device() if index is None else index
    try:
        segs = sorted((s for s in torch.cuda.memory_snapshot() if s.get("device", index) == index),
                      key=lambda s: s.get("address", 0))
        layout = [(str(s.get("segment_type", "large")),
                   tuple((int(b["size"]), b.get("state") == "active_allocated") for b in s.get("blocks", ())))
                  for s in segs]
        if sum(n for _, blocks in layout for n, used in blocks if used) != torch.cuda.memory_allocated(index):
            return None
    except Exception:   # a snapshot this torch cannot give, or of another shape: no layout
        return None
    return layout


def pci_bus_id(cuda_index: int) -> str:
    """The PCI bus id of a CUDA device in NVML's form, ``domain:bus:device.function``
    (e.g. ``00000000:65:00.0``), from ``torch.cuda.get_device_properties``."""
    p = torch.cuda.get_device_properties(cuda_index)
    return f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"


def device_report() -> DeviceReport:
    cuda = torch.cuda.is_available()
    nv, nv_reason = _nvml()
    report = DeviceReport(cuda_available=cuda, nvml_available=nv is not None)
    if nv is not None:
        try:
            driver = nv.nvmlSystemGetDriverVersion()
            driver = driver.decode() if isinstance(driver, bytes) else str(driver)
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                name = nv.nvmlDeviceGetName(h)
                name = name.decode() if isinstance(name, bytes) else str(name)
                major, minor = nv.nvmlDeviceGetCudaComputeCapability(h)
                report.gpus.append(GpuFacts(i, name, int(mem.total), int(mem.free), int(mem.used),
                                            driver, f"{major}.{minor}", "nvml"))
        except Exception as exc:
            report.reason = f"NVML answered but failed to list devices: {exc}"
    if not report.gpus and cuda:
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            major, minor = torch.cuda.get_device_capability(i)
            report.gpus.append(GpuFacts(i, torch.cuda.get_device_name(i), int(total), int(free),
                                        int(total - free), "unknown (no NVML)", f"{major}.{minor}",
                                        "torch.cuda"))
    if not cuda:
        report.reason = ("torch.cuda.is_available() is False: no CUDA GPU is visible to this "
                         "process" + (f"; {nv_reason}" if nv_reason else ""))
    elif nv is None:
        report.reason = nv_reason
    return report


def gpu_name(index: int = 0) -> str | None:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(index)
