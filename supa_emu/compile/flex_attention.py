"""Inductor lowerings of flex attention for supa cards: the CPU C++ kernel for inference, the
attention's dense definition compiled as ordinary ops for training.

Inductor lowers the `flex_attention` HOP to its CPU C++ template on "cpu", to Metal on "mps" and
to Triton everywhere else, and its backward HOP to Triton only. Emulated cards have host memory
and no Triton, so for supa:

- forward without logsumexp (`no_grad`, inference): the CPU C++ template (`lower_cpu`), which
  runs on supa memory like every other C++ kernel of the supa backend;
- forward with logsumexp (training) and `flex_attention_backward`: there is no CPU kernel for
  either. The HOP's own dense definition (`sdpa_dense`, `sdpa_dense_backward`, what eager flex
  attention runs) is traced to aten ops with Inductor's decompositions and those ops are lowered
  in place of the HOP node, so Inductor fuses them with the rest of the graph like any code.

Why at lowering time: it is the one place that already chooses a kernel per device, and
`lowerings` is Inductor's registration table; the HOP stays a HOP through Dynamo, AOTAutograd
(its autograd rule makes the backward HOP) and the partitioner, so graphs, export and other
devices see what they always did. A decomposition before AOTAutograd would need a hook into the
HOP's tracing rule (Python dispatch, which knows no devices) for every graph with supa tensors;
a fallback kernel would run the eager dense code, unfused, vmapping the score_mod again on every
call. Like eager flex attention, the dense form materialises the (B, H, Lq, Lkv) scores in fp32.
"""

from __future__ import annotations

import copy

import torch
import torch.fx
from torch._higher_order_ops.flex_attention import sdpa_dense, sdpa_dense_backward
from torch._inductor import config, ir
from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported, lower_cpu
from torch._inductor.lowering import lowerings, register_lowering
from torch._inductor.pattern_matcher import fwd_only
from torch._inductor.virtualized import V
from torch.utils import _pytree as pytree

from supa_emu.device_type import DEVICE_TYPE

FORWARD = torch.ops.higher_order.flex_attention
BACKWARD = torch.ops.higher_order.flex_attention_backward

_installed = False


def _on_supa(query) -> bool:
    return query.get_device().type == DEVICE_TYPE


def _batchable(graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`graph_module` with its dtype conversions spelled as `aten._to_copy`.

    The dense definition vmaps the score_mod, mask_mod and joint graphs over (b, h, q, kv). By the
    time Inductor lowers a graph, Inductor's decompositions have turned `.to(dtype)` in those
    graphs into `prims.convert_element_type`, which has no batching rule: vmap would run it once
    per score element, and the trace would grow with Lq * Lkv. `_to_copy` batches.
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


def _inline_dense(dense, args: tuple):
    """Lowers `dense(*args)` (an eager HOP implementation) in place of the current HOP node.

    `args` are the lowering's arguments: TensorBoxes, `ir.Subgraph`s (score_mod, mask_mod,
    joint graphs) and constants. The FX node's own arguments give each tensor its example value
    (sizes, strides, SymInts as Dynamo recorded them); the subgraphs go in as the graph modules
    they wrap; the rest stays constant.
    """
    node = V.graph.current_node
    values, spec = pytree.tree_flatten(args)
    nodes = pytree.tree_leaves(node.args)
    if len(nodes) != len(values):
        raise NotImplementedError(f"supa flex attention: cannot match the arguments of {node.format_node()}")
    operands, examples = [], []
    for i, (value, arg) in enumerate(zip(values, nodes)):
        if isinstance(value, ir.Subgraph):
            values[i] = _batchable(value.graph_module)
        elif isinstance(arg, torch.fx.Node) and isinstance(
                arg.meta.get("val"), (torch.Tensor, torch.SymInt)):
            operands.append((i, value))
            examples.append(arg.meta["val"])

    def call(*tensors):
        leaves = list(values)
        for (i, _), tensor in zip(operands, tensors):
            leaves[i] = tensor
        return dense(*pytree.tree_unflatten(leaves, spec))

    with V.fake_mode:  # tensors the trace creates (aranges, fills) are example values too
        with torch.no_grad():
            graph_module = fwd_only(call, examples, run_functional_passes=False)
    return _lower_graph(graph_module, [value for _, value in operands])


def _lower_graph(graph_module: torch.fx.GraphModule, operands: list):
    """Lowers each node of `graph_module` into the graph being compiled; returns its outputs."""
    inputs = iter(operands)
    for node in graph_module.graph.nodes:
        if node.op == "placeholder":
            value = next(inputs)
        elif node.op == "get_attr":  # a scalar the trace made (the -inf of masked scores)
            constant = getattr(graph_module, node.target)
            if constant.dim() != 0:
                raise NotImplementedError(f"supa flex attention: traced a tensor constant {node.target} "
                                          f"of shape {tuple(constant.shape)}")
            value = ir.Constant(value=constant.item(), dtype=constant.dtype, device=constant.device)
        elif node.op == "output":
            return V.graph.fetch_args_kwargs_from_env(node)[0][0]
        else:
            value = V.graph.run_node(node)
        V.graph.env[node] = value
    raise RuntimeError("supa flex attention: the traced graph has no output")


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
        return _inline_dense(sdpa_dense, args)

    return flex_attention


def _dense_backward(joint_graph: torch.fx.GraphModule):
    """`sdpa_dense_backward`, computing the gradient of each captured score_mod buffer that the
    joint graph differentiates, as the Triton lowering does.

    The eager implementation asks `buffer.requires_grad`, which the example values of a backward
    graph never have; the joint graph's outputs say it: (d score, None for b, h, q_idx, kv_idx,
    then a gradient or None per buffer).
    """
    (outputs,) = next(n for n in joint_graph.graph.nodes if n.op == "output").args
    differentiated = [grad is not None for grad in outputs[5:]]

    def dense(*args):
        *leading, score_mod_buffers, mask_mod_buffers = args
        score_mod_buffers = tuple(
            buffer.detach().requires_grad_() if needs_grad else buffer
            for buffer, needs_grad in zip(score_mod_buffers, differentiated))
        return sdpa_dense_backward(*leading, score_mod_buffers, mask_mod_buffers)

    return dense


def _backward(original):
    def flex_attention_backward(*args):
        if not _on_supa(args[0]):
            return original(*args)
        return _inline_dense(_dense_backward(args[8].graph_module), args)

    return flex_attention_backward


def install() -> None:
    """Idempotent: wraps Inductor's lowerings of the two flex attention HOPs for supa nodes."""
    global _installed
    if _installed:
        return
    for hop, make in ((FORWARD, _forward), (BACKWARD, _backward)):
        register_lowering(hop, type_promotion_kind=None)(make(lowerings[hop]))
    _installed = True
