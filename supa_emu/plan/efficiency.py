"""The fraction of a card's peak an operator reaches, by operator family and size: data, with sources.

Each curve is a table of (work, fraction of peak) points, read between points on a log scale of
the work and flat beyond the ends: FLOPs of one launch for the arithmetic families, bytes moved
for the memory family. Small launches reach little of the peak (too few tiles to fill the card,
tails, the prologue of each kernel); large ones level off below it.

Sources (none is a measurement of these cards; item 6a of issue 48 measures an H200 and replaces
the NVIDIA figures with its table once a card is lent):
- gemm: cuBLAS bf16 GEMMs on Hopper reach about 70-80% of the dense peak at large square sizes
  (the throughput NVIDIA's "Matrix Multiplication Background" guide and public GEMM sweeps show
  on H100: 650-750 TFLOPS of 989); the fall-off below 1e9 FLOPs follows the wave quantisation
  those guides describe (a launch smaller than one wave of tiles leaves SMs idle).
- attention: PyTorch's fused attention on Hopper is FlashAttention-2's algorithm, which the
  FlashAttention-3 paper (Shah et al., 2024) measures at about 35% of an H100's bf16 peak forward
  and less backward; taken as 0.40 forward and 0.30 backward at large sizes.
- conv: as gemm, a little lower (implicit GEMM with im2col overheads).
- memory: element-wise and reduction kernels stream at about 85-90% of the HBM peak when large
  (STREAM-like copies on HBM cards); small ones are dominated by their launch, counted apart.
"""

import bisect
import math

CURVES = {
    # FLOPs of the launch -> fraction of the dtype's dense peak
    "gemm": ((1e6, 0.02), (1e8, 0.15), (1e9, 0.40), (1e10, 0.62), (1e11, 0.72), (1e12, 0.76)),
    "conv": ((1e6, 0.02), (1e8, 0.12), (1e9, 0.35), (1e10, 0.55), (1e11, 0.65), (1e12, 0.68)),
    "attention_forward": ((1e8, 0.08), (1e9, 0.20), (1e10, 0.32), (1e11, 0.40)),
    "attention_backward": ((1e8, 0.06), (1e9, 0.15), (1e10, 0.25), (1e11, 0.30)),
    # bytes moved -> fraction of the memory's peak bandwidth
    "memory": ((1e4, 0.05), (1e6, 0.40), (1e7, 0.70), (1e8, 0.85), (1e9, 0.88)),
}
# Copies between host and card reach this fraction of the link's per-direction bandwidth
# (pinned memory over PCIe 5.0 x16: 50-55 of 63 GB/s in NVIDIA's bandwidthTest on H100 hosts).
HOST_LINK_EFFICIENCY = 0.85


def fraction(curve: str, work: float) -> float:
    """The fraction of the peak reached by a launch of `work` (FLOPs, or bytes for "memory")."""
    points = CURVES[curve]
    if work <= points[0][0]:
        return points[0][1]
    if work >= points[-1][0]:
        return points[-1][1]
    at = bisect.bisect_left([w for w, _ in points], work)
    (w0, f0), (w1, f1) = points[at - 1], points[at]
    return f0 + (f1 - f0) * (math.log(work) - math.log(w0)) / (math.log(w1) - math.log(w0))
