"""Data-parallel serving: N engine ranks in one torch.distributed process group.

- ``group``: the rendezvous and process groups (gloo on CPU, NCCL on CUDA, a gloo control group).
- ``lockstep``: with expert parallelism, ranks agree every step whether any has work.
- ``rank``: one rank's engine server (a child of the front door, or alone: external LB).
- ``frontdoor``: one HTTP front door over the ranks (vLLM's internal load balancer).
- ``launcher``: ``kvmesh serve --data-parallel-size N``: ranks + front door, supervised.
"""
