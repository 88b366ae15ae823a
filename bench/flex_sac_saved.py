"""What selective activation checkpointing keeps per layer: compiled flex attention vs SDPA.

    SUPA_EMULATE=1 python bench/flex_sac_saved.py     # the emulated card
    python bench/flex_sac_saved.py                    # a CUDA GPU, where there is one

torchtitan's llama3 plans hold 6.2 GiB more with flex attention than with SDPA under its
selective checkpointing (docs/frameworks.md). This checks the cause on a small model of the same
shape of computation: layers of q/k/v projections, a new q and k made from them (as RoPE does),
attention, an output projection, each layer under `checkpoint` with a policy that follows
torchtitan 0.3.0's rule (save matrix products except every second one, the card's attention ops,
flex attention and Inductor's compiled regions; recompute the rest). torchtitan compiles
flex_attention with `wrap_inductor_compiled_regions=True`, so the compiled forward is one
`inductor_compiled_code` call whose outputs (the tensors AOTAutograd saves for the backward among
them) the policy keeps. Prints the bytes each layer holds after the forward with each attention,
their difference, and the sizes of q and k, in MiB.
"""

import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

DEVICE = torch.accelerator.current_accelerator()
MEMORY = getattr(torch, DEVICE.type)
MiB = 2 ** 20
B, HEADS, KV_HEADS, L, D, LAYERS = 1, 8, 2, 1024, 64, 4
WIDTH = HEADS * D
MM = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)


def _saved_ops() -> set:
    ops = {*MM, torch._higher_order_ops.flex_attention}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        ops.add(getattr(torch.ops.aten, name).default)
    wrapped = getattr(torch._higher_order_ops, "inductor_compiled_code", None)
    if wrapped is None:
        sys.exit("this torch has no inductor_compiled_code op (torch 2.10 or later has it)")
    ops.add(wrapped)
    return ops


SAVED = _saved_ops()


def policy():
    counts = {False: 0, True: 0}  # matrix products seen, in the forward and in the recompute

    def decide(ctx, func, *args, **kwargs):
        if func in MM:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in SAVED else CheckpointPolicy.PREFER_RECOMPUTE

    return decide


def held_per_layer(attention: str) -> float:
    flex = torch.compile(flex_attention, options={"wrap_inductor_compiled_regions": True})
    mask = create_block_mask(lambda b, h, q, kv: q >= kv, B, None, L, L, device=DEVICE)

    def layer(x, wq, wk, wv, wo):
        q = (x @ wq).view(B, L, HEADS, D) * 1.5  # a new tensor from each projection, as RoPE makes
        k = (x @ wk).view(B, L, KV_HEADS, D) * 1.5
        v = (x @ wv).view(B, L, KV_HEADS, D)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if attention == "flex":
            o = flex(q, k, v, block_mask=mask, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return o.transpose(1, 2).reshape(B, L, WIDTH) @ wo

    def weight(cols):
        return (torch.randn(WIDTH, cols, device=DEVICE, dtype=torch.bfloat16) * 0.02).requires_grad_()

    weights = [[weight(WIDTH), weight(KV_HEADS * D), weight(KV_HEADS * D), weight(WIDTH)] for _ in range(LAYERS)]
    x = torch.randn(B, L, WIDTH, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):  # the second round: gradients and compiled code exist, so only activations differ
        MEMORY.synchronize()
        before = MEMORY.memory_allocated()
        h = x
        for w in weights:
            h = checkpoint(layer, h, *w, use_reentrant=False,
                           context_fn=lambda: create_selective_checkpoint_contexts(policy()))
        MEMORY.synchronize()
        held = (MEMORY.memory_allocated() - before) / LAYERS / MiB
        h.sum().backward()
        del h
    return held


if __name__ == "__main__":
    sdpa, flex = held_per_layer("sdpa"), held_per_layer("flex")
    print(json.dumps({"device": str(DEVICE), "torch": torch.__version__, "MiB per layer": {
        "sdpa": sdpa, "flex": flex, "flex - sdpa": flex - sdpa,
        "q": B * L * WIDTH * 2 / MiB, "k": B * L * KV_HEADS * D * 2 / MiB}}, indent=1))
