"""What a collective costs in seconds: its bytes over the link it crosses, times NCCL's algorithm
factor. Pure formulas; ``predict.timing`` applies them to the collectives a fake run issues
(DTensor's on the fake process group) and ``predict.plan_time`` to those a layout implies.

NCCL's bus bandwidth (nccl-tests, doc/PERFORMANCE.md, https://github.com/NVIDIA/nccl-tests/blob/master/
doc/PERFORMANCE.md): for ``n`` ranks each with a link of bandwidth B (one direction), a collective of
S bytes takes at best t = (S / B) × factor, the factor being

* all-reduce 2(n−1)/n (ring or tree alike: "2(n-1) data transfers" per element over n links);
* reduce-scatter and all-gather (n−1)/n, S the *whole* array (the all-gather's output, the
  reduce-scatter's input: "S is the size in bytes of the total array");
* all-to-all (n−1)/n; broadcast, reduce and send/receive 1.

B is the bottleneck link: NVLink inside a node, the network across nodes (a ring that leaves the node
runs at the network's speed), PCIe where the card has no NVLink (``card_speeds.Links``). NB: this is
the best case NCCL's own tests define; latency (a few µs a call) and the protocols' efficiency below
the bus peak are not modelled, so the assumption ``COMM_ASSUMPTION`` says so in every answer.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BUS_FACTOR_SOURCE", "COMM_ASSUMPTION", "CollectiveCost", "bus_factor", "collective_seconds",
           "link_for"]

BUS_FACTOR_SOURCE = ("NCCL's bus bandwidth factors, nccl-tests doc/PERFORMANCE.md: all-reduce 2(n-1)/n, "
                     "all-gather and reduce-scatter (n-1)/n of the whole array, all-to-all (n-1)/n, send/recv 1")
COMM_ASSUMPTION = (f"collectives at the link's full one-direction bandwidth ({BUS_FACTOR_SOURCE}); no latency, "
                   f"no protocol overhead")

_FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
            "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
            "broadcast": lambda n: 1.0, "send_recv": lambda n: 1.0}


def bus_factor(kind: str, n: int) -> float:
    """NCCL's factor for ``kind`` over ``n`` ranks (0 for one rank: nothing moves)."""
    if kind not in _FACTORS:
        raise ValueError(f"unknown collective {kind!r}: one of {', '.join(_FACTORS)}")
    if n <= 1:
        return 0.0
    return _FACTORS[kind](n)


def collective_seconds(kind: str, nbytes: int, n: int, link_bytes_s: float) -> float:
    """Seconds of one ``kind`` collective of ``nbytes`` (S as nccl-tests counts it) over ``n`` ranks whose
    bottleneck link moves ``link_bytes_s`` bytes a second in one direction."""
    return nbytes * bus_factor(kind, n) / link_bytes_s if nbytes else 0.0


def link_for(links, span: int) -> tuple[float | None, str]:
    """(bytes/s, name) of the bottleneck link of a group spanning ``span`` consecutive GPUs (the
    group's size times its stride in the mesh): inside one node NVLink (PCIe without it), else the
    network (None where the card table has no figure)."""
    if span <= links.gpus_per_node:
        return links.node_gbs * 1e9, "NVLink" if links.nvlink_gbs is not None else "PCIe"
    return (None if links.network_gbs is None else links.network_gbs * 1e9), "network"


@dataclass
class CollectiveCost:
    """One kind of collective's share of a step: how many, their bytes (S), seconds, over which link."""
    kind: str
    group: int
    link: str
    count: int = 0
    nbytes: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"kind": self.kind, "group": self.group, "link": self.link, "count": self.count,
                "bytes": self.nbytes, "seconds": self.seconds}
