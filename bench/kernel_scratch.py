"""Kernel scratch per operator family: transient device bytes of one call beyond what it keeps.

    SUPA_EMULATE=1 python bench/kernel_scratch.py      # the emulated card
    python bench/kernel_scratch.py                     # a CUDA GPU, where there is one

Shapes are those of tests/data/fidelity/memory_probe.py's GPT (T tokens, width 1024, vocabulary
50257, bf16 unless named). Each figure is `max_memory_allocated()` minus what stays allocated, in
MiB, around one call made after a warm-up call (so the BLAS workspaces and library caches exist).
Figures that include tensors the call creates and frees itself (a forward output before its
backward, the incoming gradient) say so in their names. docs/operator_memory.md compares the two cards.
"""

import json

import torch
import torch.nn.functional as F

DEVICE = torch.accelerator.current_accelerator()
MEMORY = getattr(torch, DEVICE.type)
MiB = 2 ** 20


def scratch(fn):
    fn()
    MEMORY.synchronize()
    MEMORY.reset_peak_memory_stats()
    kept = fn()  # noqa: F841  (held while what stays allocated is read)
    MEMORY.synchronize()
    return round((MEMORY.max_memory_allocated() - MEMORY.memory_allocated()) / MiB, 3)


def families(T: int) -> dict:
    d, V, bf = 1024, 50257, torch.bfloat16

    def rand(*shape, dtype=bf, **kw):
        return torch.randn(*shape, device=DEVICE, dtype=dtype, **kw)

    x, W, b, g = rand(T, d), rand(4 * d, d), rand(4 * d), rand(T, 4 * d)
    head, grad_logits = rand(V, d), rand(T, V)
    xf, Wf, bf32, gf = x.float(), W.float(), b.float(), g.float()
    ln = torch.nn.LayerNorm(d).to(DEVICE, bf)
    x3 = rand(T // 256, 256, d, requires_grad=True)
    logits = rand(T, V, dtype=torch.float32, requires_grad=True)
    target = torch.randint(0, V, (T,), device=DEVICE)
    emb = torch.nn.Embedding(V, d).to(DEVICE, bf)
    idx = torch.randint(0, V, (T // 256, 256), device=DEVICE)
    scores = rand(T // 256, 16, 256, 256)
    flat = rand(6_250_000, dtype=torch.float32)

    def layer_norm():
        o = ln(x3)
        return torch.autograd.grad(o, [x3, ln.weight, ln.bias], torch.ones_like(o))

    def embedding():
        o = emb(idx)
        return torch.autograd.grad(o, [emb.weight], torch.ones_like(o))

    return {
        "bf16 linear with bias (T,1024)x(1024,4096)": scratch(lambda: F.linear(x, W, b)),
        "bf16 grad-input (T,4096)x(4096,1024)": scratch(lambda: g @ W),
        "bf16 grad-weight (4096,T)x(T,1024)": scratch(lambda: g.t() @ x),
        "bf16 vocabulary head grad-input (T,50257)x(50257,1024)": scratch(lambda: grad_logits @ head),
        "fp32 linear with bias": scratch(lambda: F.linear(xf, Wf, bf32)),
        "fp32 grad-input": scratch(lambda: gf @ Wf),
        "fp32 grad-weight": scratch(lambda: gf.t() @ xf),
        "layer_norm forward+backward (incl. output and incoming gradient)": scratch(layer_norm),
        "cross_entropy fp32 forward+backward (incl. log-probabilities and nll gradient)": scratch(
            lambda: torch.autograd.grad(F.cross_entropy(logits, target), [logits])),
        "embedding forward+backward (incl. output and incoming gradient)": scratch(embedding),
        "softmax bf16 (B,16,256,256)": scratch(lambda: scores.softmax(-1)),
        "log_softmax fp32 (T,50257)": scratch(lambda: logits.detach().log_softmax(-1)),
        "sum fp32 6.25M": scratch(lambda: flat.sum()),
        "norm fp32 6.25M": scratch(lambda: flat.norm()),
        "gelu bf16 (T,4096)": scratch(lambda: F.gelu(g)),
    }


if __name__ == "__main__":
    print(json.dumps({"device": str(DEVICE), "torch": torch.__version__,
                      "MiB": {T: families(T) for T in (512, 2048)}}, indent=1))
