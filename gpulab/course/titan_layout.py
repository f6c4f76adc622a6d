"""Lesson 12: one layout as torchtitan builds it, Llama 3.1 70B over 256 H100s (FSDP 32 x TP 8, the
torchtitan team's published table 4), its device mesh drawn, and one rank's model states counted
beside the memory torchtitan published for that layout.

torchtitan lays its ranks out as a ``DeviceMesh`` with ``tp`` the innermost dimension
(``torchtitan.distributed.ParallelDims``: ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``), so a
tensor-parallel group is 8 consecutive ranks, one host's NVLink-connected GPUs, and an FSDP group is
every 8th rank, across hosts. Under FSDP2 (torchtitan's default: fp32 parameters sharded over
``dp_shard``, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), each rank keeps 1/32 of
its TP shard: fp32 weight, fp32 gradient and AdamW's two fp32 moments, 16 bytes a parameter. Counted
from a one-layer build on the meta device (instant); the activations and the allocator's cache, the
rest of torchtitan's figure, are ``gpulab fit``'s to measure (minutes on a CPU for 70B).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TITAN_70B", "TitanLayout", "TitanPublished", "titan_layout", "titan_mesh_figure"]


@dataclass(frozen=True)
class TitanPublished:
    """A figure torchtitan's team published, quoted with its source and setting."""
    quote: str
    gib: float
    setting: str
    where: str


TITAN_70B = TitanPublished(
    quote="| 2D | 829 | 71.9 |", gib=71.9,
    setting=("Llama 3.1 70B, 256 H100s (96 GB HBM2e), FSDP 32 x TP 8, local batch 16 x 8192, full activation "
             "checkpointing, torch.compile, float8 linears; memory: the largest max_memory_reserved of any rank"),
    where=("torchtitan benchmarks/llama3_h100_202412_torchtitan.md, table 4 (pytorch/torchtitan @ "
           "820504e20d1149fbf0b98c567af24c4b0433b22d; seq_len 8192 from train_configs/llama3_70b.toml @ 9dec370)"))


@dataclass(frozen=True)
class TitanLayout:
    model: str
    dp_shard: int
    tp: int
    pp: int
    gpus_per_host: int
    parameters_per_rank: int      # counted: matrices / tp, norms whole, all / dp_shard
    bytes_per_parameter: int
    published: TitanPublished

    @property
    def gpus(self) -> int:
        return self.dp_shard * self.tp * self.pp

    @property
    def states_bytes(self) -> int:
        return self.parameters_per_rank * self.bytes_per_parameter

    @property
    def published_bytes(self) -> float:
        return self.published.gib * 2 ** 30

    @property
    def error_percent(self) -> float:
        from gpulab.views import error_percent
        return error_percent(self.states_bytes, self.published_bytes)

    @property
    def rest_bytes(self) -> float:
        """What torchtitan's figure holds beyond the counted states."""
        return self.published_bytes - self.states_bytes

    def figure(self):
        return titan_mesh_figure(self.dp_shard, self.tp, self.pp, self.gpus_per_host)

    def _repr_html_(self) -> str:
        from gpulab.tables import html_table
        from gpulab.units import format_bytes
        rows = [["model states of one rank (counted, 16 B a parameter)", format_bytes(self.states_bytes),
                 f"{self.error_percent:+.0f}%"],
                ["torchtitan's published memory per GPU (measured on H100s)", format_bytes(self.published_bytes), ""],
                ["the rest: activations, loss, gathered layers, allocator cache", format_bytes(self.rest_bytes), ""]]
        return html_table(["", "per rank", "error"], rows, caption=(
            f"{self.model}, {self.gpus} GPUs = dp_shard {self.dp_shard} x tp {self.tp} x pp {self.pp}: "
            f"{self.parameters_per_rank:,} parameters a rank. Published: {self.published.quote} "
            f"({self.published.where}; {self.published.setting})"))


def titan_layout(model: str = "hf:llama-3.1-70b", *, dp_shard: int = 32, tp: int = 8, pp: int = 1,
                 gpus_per_host: int = 8, published: TitanPublished = TITAN_70B) -> TitanLayout:
    """One rank's parameters in torchtitan's layout, counted on the meta device from a one-layer build:
    every 2-D weight split tp ways (the embedding and the head vocabulary-parallel, as torchtitan's
    plan splits them), the norms whole, the layers spread over pp stages (the first stage's count,
    with the embedding), and all of it sharded dp_shard ways by FSDP2."""
    import torch

    from gpulab.models import hf_configs
    from gpulab.models.workload import resolve_workload
    from gpulab.predict.layer_pattern import with_depth
    for name, v in (("dp_shard", dp_shard), ("tp", tp), ("pp", pp), ("gpus_per_host", gpus_per_host)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a whole number of 1 or more, got {v!r}")
    config = resolve_workload(model).config
    if config.num_hidden_layers % pp:
        raise ValueError(f"pp must divide the model's {config.num_hidden_layers} layers, got {pp}")
    with torch.device("meta"):
        one = hf_configs.build_model(with_depth(config, 1), torch.bfloat16)

    def count(module) -> int:
        return sum(p.numel() // (tp if p.dim() == 2 else 1) for p in module.parameters())
    layers = config.num_hidden_layers // pp * count(one.model.layers[0])
    ends = count(one.model.embed_tokens) + (0 if pp > 1 else count(one.model.norm) + count(one.lm_head))
    return TitanLayout(model, dp_shard, tp, pp, gpus_per_host, (layers + ends) // dp_shard, 16, published)


def titan_mesh_figure(dp_shard: int = 32, tp: int = 8, pp: int = 1, gpus_per_host: int = 8):
    """The dp_shard x tp grid of ranks for each pipeline stage, ranks numbered as torchtitan's mesh
    numbers them (tp innermost), one tensor-parallel group and one FSDP group outlined, and the hosts
    (``gpus_per_host`` consecutive ranks) shaded alternately."""
    from matplotlib.patches import Rectangle

    from gpulab.plots import LessonFigure
    fig = LessonFigure(figsize=(3.2 * pp + 2.4, max(3.0, 0.16 * dp_shard + 1.4)), dpi=100, layout="constrained")
    axes = fig.subplots(1, pp, squeeze=False)[0]
    for stage, ax in enumerate(axes):
        for d in range(dp_shard):
            for t in range(tp):
                rank = (stage * dp_shard + d) * tp + t
                shade = "#c6dbef" if (rank // gpus_per_host) % 2 else "#eef3fa"
                ax.add_patch(Rectangle((t, d), 1, 1, facecolor=shade, edgecolor="white", linewidth=0.5))
                if dp_shard <= 8 or d in (0, 1, dp_shard - 1):
                    ax.text(t + 0.5, d + 0.5, str(rank), ha="center", va="center", fontsize=6)
        ax.add_patch(Rectangle((0, 0), tp, 1, fill=False, edgecolor="#C44E52", linewidth=2,
                               label=f"a TP group: {tp} consecutive ranks"))
        ax.add_patch(Rectangle((0, 0), 1, dp_shard, fill=False, edgecolor="#4C72B0", linewidth=2,
                               label=f"an FSDP group: {dp_shard} ranks, every {tp}th"))
        ax.set_xlim(0, tp)
        ax.set_ylim(dp_shard, 0)
        ax.set_xlabel("tp index")
        ax.set_ylabel("dp_shard index")
        ax.set_title(f"pipeline stage {stage}" if pp > 1 else f"{dp_shard * tp} ranks", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    axes[0].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    fig.suptitle(f"torchtitan's mesh: dp_shard {dp_shard} x tp {tp} x pp {pp}; shading: hosts of "
                 f"{gpus_per_host} GPUs", fontsize=9)
    return fig
