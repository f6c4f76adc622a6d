"""gpulab.measure.gpu without a GPU: NVML is matched to CUDA devices by PCI bus id, never by index."""
import types

import pytest
import torch

from gpulab.measure import gpu


class FakeNvml:
    """Two GPUs in NVML's (PCI) order; records which handle was asked for."""
    def __init__(self):
        self.asked = []
        self.used = {"00000000:17:00.0": 1_000, "00000000:65:00.0": 2_000}

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        self.asked.append(bus)
        if bus not in self.used:
            raise RuntimeError(f"NVML has no device at {bus}")
        return bus

    def nvmlDeviceGetHandleByIndex(self, i):  # must not be used to map a CUDA device
        raise AssertionError("a CUDA index is not an NVML index")

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=self.used[handle])


@pytest.fixture
def two_gpus(monkeypatch):
    nv = FakeNvml()
    monkeypatch.setattr(gpu, "_nvml", lambda: (nv, ""))
    # CUDA's order (fastest first, or CUDA_VISIBLE_DEVICES=1,0): CUDA 0 is the card at bus 0x65
    props = {0: types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x65, pci_device_id=0),
             1: types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x17, pci_device_id=0)}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    return nv


def test_nvml_used_is_read_for_the_same_physical_gpu(two_gpus):
    assert gpu.nvml_used_bytes(0) == 2_000          # NVML's device 1, the card at bus 0x65
    assert gpu.nvml_used_bytes(1) == 1_000
    assert two_gpus.asked == ["00000000:65:00.0", "00000000:17:00.0"]


def test_nvml_used_is_none_when_nvml_cannot_find_the_device(two_gpus, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0xAB, pci_device_id=0))
    assert gpu.nvml_used_bytes(0) is None


def test_nvml_used_without_nvml(monkeypatch):
    monkeypatch.setattr(gpu, "_nvml", lambda: (None, "no driver"))
    assert gpu.nvml_used_bytes(0) is None
