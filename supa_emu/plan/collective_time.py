"""How long a collective takes on the job's topology: NCCL-style ring and tree costs over the profile's links.

A collective of `nbytes` (the larger of what it reads and writes on this rank, as call_record
counts it) over a group of n ranks that spans h hosts, with c of its ranks on each host:

- within one host the ranks talk over the card-to-card link (its per-direction bandwidth);
- across hosts every ring crosses each host boundary on one card's NIC, and NCCL runs one ring per
  NIC, so the group's bus bandwidth is min(card link, c x NIC) (c = 1 for a data-parallel group
  with one rank per host: the NIC alone);
- ring costs as nccl-tests defines bus bandwidth: all_reduce moves 2(n-1)/n of the buffer,
  all_gather, reduce_scatter and all_to_all (n-1)/n, broadcast and reduce the buffer once,
  point-to-point the buffer once; each of a ring's steps pays the link's latency;
- all_reduce takes the tree instead where it is faster (NCCL's double binary tree: 2 log2(n)
  steps of latency, each byte crossing twice), which it is for small buffers on large groups.

Latencies are per step; efficiencies are the fraction of a link's bandwidth NCCL's bus bandwidth
reaches (nccl-tests on NVLink 4 reports about 80% of 450 GB/s per direction; RDMA NICs about
90% of line rate). Neither congestion nor SHARP/NVLS in-network reduction is modelled.
"""

import math

LINK_LATENCY = 2e-6  # seconds per ring step within a host (NCCL's NVLink latency, order of magnitude)
NETWORK_LATENCY = 6e-6  # seconds per ring step across hosts (RDMA, order of magnitude)
LINK_EFFICIENCY = 0.80
NETWORK_EFFICIENCY = 0.90
BITS = 8


def bus_bandwidth(profile, nic_gbps: float, hosts: int, per_host: int) -> float:
    """Bytes/s of the group's bus bandwidth (see the module's docstring)."""
    link = profile.card_link_bandwidth * LINK_EFFICIENCY
    if hosts <= 1:
        return link
    return min(link, per_host * nic_gbps * 1e9 / BITS * NETWORK_EFFICIENCY)


def seconds(op: str, nbytes: float, group_size: int, hosts: int, profile, nic_gbps: float) -> float:
    """The time of one collective call `op` on this rank (0 for a group of one)."""
    n = group_size
    if n <= 1:
        return 0.0
    hosts = max(1, hosts)
    per_host = max(1, -(-n // hosts))
    bw = bus_bandwidth(profile, nic_gbps, hosts, per_host)
    alpha = NETWORK_LATENCY if hosts > 1 else LINK_LATENCY
    base = op.replace("_coalesced", "").replace("_into_tensor", "").replace("_tensor", "").replace("_single", "")
    if base == "barrier":
        return 2 * math.ceil(math.log2(n)) * alpha
    if base == "all_reduce":
        ring = 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha
        tree = 2 * nbytes / bw + 2 * math.ceil(math.log2(n)) * alpha
        return min(ring, tree)
    if base in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n * nbytes / bw + (n - 1) * alpha
    if base in ("broadcast", "reduce"):
        return nbytes / bw + (n - 1) * alpha
    if base in ("send", "recv", "recv_anysource"):
        return nbytes / bw + alpha
    raise ValueError(f"no time model for the collective {op!r}")
