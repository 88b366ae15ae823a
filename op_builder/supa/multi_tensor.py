"""Helpers the multi-tensor optimizer ops share: list checks, fp32 working copies, the noop flag.

DeepSpeed's fused kernels load fp16/bf16 values, do all arithmetic in fp32 and round once on
store. A chain of `torch._foreach_*` ops on 16-bit tensors would round after every op instead, so
the fallbacks compute on fp32 copies of 16-bit lists and write the results back once.
"""

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)


def check_lists(tensor_lists):
    """Raise RuntimeError("Size mismatch among tensor lists") unless every list has the same
    length, as DeepSpeed's multi_tensor_apply does; an empty group (all lists empty) is valid."""
    if len({len(tensors) for tensors in tensor_lists}) > 1:
        raise RuntimeError(f"Size mismatch among tensor lists: lengths {[len(t) for t in tensor_lists]}")


def as_fp32(tensors):
    """fp32 tensors holding the values of `tensors` (the same objects when they already are fp32)."""
    if tensors and tensors[0].dtype in LOW_PRECISION:
        return [t.float() for t in tensors]
    return list(tensors)


def store(dst, src):
    """Write fp32 results back into the caller's tensors (no-op when they are the same tensors)."""
    if dst and dst[0] is not src[0]:
        torch._foreach_copy_(dst, src)


def step_skipped(noop_flag):
    """True when DeepSpeed's overflow/noop flag asks to skip this step.

    One host read per optimizer call (not per tensor); the fused path avoids even that by handing
    the flag to the kernel.
    """
    return noop_flag is not None and noop_flag.numel() > 0 and bool(noop_flag.reshape(-1)[0].item() != 0)


def same_dtype(*lists):
    dtype = lists[0][0].dtype
    return all(t.dtype == dtype for lst in lists for t in lst)
