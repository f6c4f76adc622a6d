"""Memory on several GPUs: each rank of DDP, ZeRO and FSDP2, measured.

* ``runner``: ``run_distributed``: an experiment in W local worker processes joined by
  ``torch.distributed`` (gloo on loopback, nccl with a GPU per rank), each under the tracker;
  failed or hung workers reported, stopped and joined;
* ``sharding``: the strategies (DDP, ZeRO-1, FSDP2 with and without resharding) measured per
  rank and split into model states, gathered parameters and communication buffers, beside ZeRO's
  formula.
"""
__all__: list[str] = []
