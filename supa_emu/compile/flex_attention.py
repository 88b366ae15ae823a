"""Inductor lowerings of flex attention for supa cards: the CPU C++ kernel for inference, the
emulator's fused kernels (flex_kernels.py) for training.

Inductor lowers the `flex_attention` HOP to its CPU C++ template on "cpu", to Metal on "mps" and
to Triton everywhere else, and its backward HOP to Triton only. Emulated cards have host memory
and no Triton, so for supa:

- forward without logsumexp (`no_grad`, inference): the CPU C++ template (`lower_cpu`), which
  runs on supa memory like every other C++ kernel of the supa backend;
- forward with logsumexp (training) and `flex_attention_backward`: there is no CPU kernel for
  either. They become calls of `supa_emu::flex_attention` and `supa_emu::flex_attention_backward`,
  extern kernels that hold on the card what the Triton templates hold (output, log-sum-exp and row
  maxima; dq, dk, dv), not the (B, H, Lq, Lkv) scores of the dense definition. The backward's
  delta (sum(out * grad_out), float32) is lowered here as Inductor ops, as the Triton lowering does.

Why at lowering time: it is the one place that already chooses a kernel per device, and
`lowerings` is Inductor's registration table; the HOP stays a HOP through Dynamo, AOTAutograd
(its autograd rule makes the backward HOP) and the partitioner, so graphs, export and other
devices see what they always did.
"""

from __future__ import annotations

import copy

import sympy
import torch
import torch.fx
from torch._inductor import config, ir
from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported, lower_cpu
from torch._inductor.lowering import lowerings, register_lowering
from torch.utils import _pytree as pytree

from supa_emu.compile import flex_kernels
from supa_emu.device_type import DEVICE_TYPE

FORWARD = torch.ops.higher_order.flex_attention
BACKWARD = torch.ops.higher_order.flex_attention_backward

_installed = False


def _on_supa(query) -> bool:
    return query.get_device().type == DEVICE_TYPE


def _batchable(graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`graph_module` with its dtype conversions spelled as `aten._to_copy`.

    The fused kernels vmap the score_mod, mask_mod and joint graphs over (b, h, q, kv). By the
    time Inductor lowers a graph, Inductor's decompositions have turned `.to(dtype)` in those
    graphs into `prims.convert_element_type`, which has no batching rule: vmap would run it once
    per score element. `_to_copy` batches.
    """
    convert = torch.ops.prims.convert_element_type.default
    if not any(node.target is convert for node in graph_module.graph.nodes):
        return graph_module
    graph_module = copy.deepcopy(graph_module)
    for node in graph_module.graph.nodes:
        if node.target is convert:
            source, dtype = node.args
            node.target, node.args, node.kwargs = torch.ops.aten._to_copy.default, (source,), {"dtype": dtype}
    graph_module.recompile()
    return graph_module


def _kernel(op, *args):
    """The fused kernel `op` called on the lowering's arguments; its results as the lowering's values."""
    def wrap(x):
        return x.wrap_for_lowering() if isinstance(x, ir.IRNode) else x

    return pytree.tree_map(wrap, ir.FallbackKernel.create(op, *args))


def _captured(buffers, what: str) -> tuple[list, list, list]:
    """What a score_mod or mask_mod captures, split for the fused kernels: (tensors, integer
    scalars, the scalars' positions among the captures).

    A captured Python int that Dynamo makes symbolic (a window or a sequence length under dynamic
    shapes; the batch offset torch's pipelining adds to each microbatch's mask_mod) reaches the
    lowering as a sympy expression; it goes to the kernel as a SymInt argument, bound when the
    compiled code runs, as the Triton template takes it as a kernel argument.
    """
    tensors, scalars, positions = [], [], []
    for position, buffer in enumerate(buffers):
        if isinstance(buffer, ir.IRNode):
            tensors.append(buffer)
        elif isinstance(buffer, int) or (isinstance(buffer, sympy.Expr) and buffer.is_integer):
            scalars.append(buffer)
            positions.append(position)
        else:
            raise NotImplementedError(f"flex attention on supa: the {what} captures {buffer!r} "
                                      f"({type(buffer).__name__}); the emulator's kernels take captured tensors "
                                      f"and integers, symbolic or not: pass it as a tensor")
    return tensors, scalars, positions


def _source(subgraph) -> str:
    return flex_kernels.graph_source(_batchable(subgraph.graph_module))


def _forward(original):
    def flex_attention(query, key, value, subgraph, block_mask, scale, kernel_options,
                       score_mod_other_buffers, mask_mod_other_buffers):
        args = (query, key, value, subgraph, block_mask, scale, kernel_options,
                score_mod_other_buffers, mask_mod_other_buffers)
        if not _on_supa(query):
            return original(*args)
        inference = not (kernel_options.get("OUTPUT_LOGSUMEXP") or kernel_options.get("OUTPUT_MAX"))
        if inference and check_cpu_supported():
            # The template renders its kernel once here, for the node's device; Inductor names
            # the code generator of a device type it does not know by `cuda_backend`.
            with config.patch(cuda_backend="cpp"):
                return lower_cpu(*args)
        return tuple(_kernel(flex_kernels.FORWARD, query, key, value,
                             *_captured(score_mod_other_buffers, "score_mod"),
                             *_captured(mask_mod_other_buffers, "mask_mod"),
                             float(scale), _source(subgraph), _source(block_mask[-1])))

    return flex_attention


def _backward(original):
    def flex_attention_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph,
                                joint_graph, block_mask, scale, kernel_options, score_mod_other_buffers,
                                mask_mod_other_buffers):
        if not _on_supa(query):
            return original(query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph, joint_graph,
                            block_mask, scale, kernel_options, score_mod_other_buffers, mask_mod_other_buffers)
        # The joint graph's outputs: (d score, None for b, h, q_idx, kv_idx, a gradient or None per buffer).
        (outputs,) = next(n for n in joint_graph.graph_module.graph.nodes if n.op == "output").args
        differentiated = [grad is not None for grad in outputs[5:]]
        # delta = sum(out * grad_out) over the head dimension, in float32: an Inductor buffer, as the
        # Triton lowering makes it.
        to_float = lowerings[torch.ops.prims.convert_element_type.default]
        product = lowerings[torch.ops.aten.mul.Tensor](to_float(out, torch.float32), to_float(grad_out, torch.float32))
        delta = lowerings[torch.ops.aten.sum.dim_IntList](product, [-1])
        grad_query, grad_key, grad_value, grads = _kernel(
            flex_kernels.BACKWARD, query, key, value, logsumexp, delta, grad_out, grad_logsumexp,
            *_captured(score_mod_other_buffers, "score_mod"), *_captured(mask_mod_other_buffers, "mask_mod"),
            float(scale), _source(fw_graph), _source(joint_graph), _source(block_mask[-1]), differentiated)
        grads = iter(grads)
        return grad_query, grad_key, grad_value, tuple(next(grads) if needed else None for needed in differentiated)

    return flex_attention_backward


def install() -> None:
    """Idempotent: wraps Inductor's lowerings of the two flex attention HOPs for supa nodes."""
    global _installed
    if _installed:
        return
    for hop, make in ((FORWARD, _forward), (BACKWARD, _backward)):
        register_lowering(hop, type_promotion_kind=None)(make(lowerings[hop]))
    _installed = True
