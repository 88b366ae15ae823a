"""Fused flex attention kernels for supa cards, called by compiled code (flex_attention.py lowers
training flex attention to them).

On a card, Inductor's Triton flex attention templates keep the (B, H, Lq, Lkv) scores in on-chip
memory: the card holds only what the templates write (torch/_inductor/kernel/flex/flex_attention.py):
- forward: the output (the query's dtype, laid out in the query's dimension order), the log-sum-exp
  and the row maxima (B, Hq, Lq, float32 each);
- backward: dq (the query's layout), dk and dv at the key and value heads (Bq, Hkv, Lkv, ...; summed
  to Bkv after the kernel where the keys broadcast over the batch), and a float32 accumulator per
  captured score_mod buffer that takes a gradient (cast to the buffer's dtype after the kernel). The
  delta it reads (sum(out * grad_out), float32) is an ordinary Inductor buffer, made by the lowering.

These kernels allocate exactly those results on the card. In compute mode they compute the values of
flex attention's dense definition (PyTorch's `sdpa_dense` and `sdpa_dense_backward`, what eager flex
attention runs) one block of queries at a time, on host tensors over the card's memory: the host's
temporaries stay bounded and never appear as card memory, as the card's scratch stays on chip. In the
planner's shapes mode they compute nothing.

score_mod, mask_mod and the joint graph reach a kernel as the Python source of their graph modules:
compiled code calls the kernel by name, and Inductor's cache hands that code to other processes.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading

import torch
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
from torch.fx.graph import _custom_builtins
from torch.utils._python_dispatch import _disable_current_modes

from supa_emu import process_state, shapes
from supa_emu.device_type import DEVICE_TYPE

# Rows of queries per block: the block's float32 scores (B x Hq x rows x Lkv) stay near this size.
BLOCK_SCORE_BYTES = 32 << 20

_LIB = torch.library.Library("supa_emu", "DEF")  # kept for the process: a Library deregisters when collected
# What a score_mod and a mask_mod capture: the tensors, the integers (SymInt: a captured int that
# is symbolic in the compiled code is bound when that code runs) and the integers' positions among
# the captures.
_CAPTURED = ("Tensor[] score_mod_buffers, SymInt[] score_mod_scalars, int[] score_mod_scalar_positions, "
             "Tensor[] mask_mod_buffers, SymInt[] mask_mod_scalars, int[] mask_mod_scalar_positions")
_LIB.define(f"flex_attention(Tensor query, Tensor key, Tensor value, {_CAPTURED}, float scale, str score_mod, "
            "str mask_mod) -> (Tensor, Tensor, Tensor)")
_LIB.define("flex_attention_backward(Tensor query, Tensor key, Tensor value, Tensor logsumexp, Tensor delta, "
            f"Tensor grad_out, Tensor? grad_logsumexp, {_CAPTURED}, float scale, str score_mod, str joint, "
            "str mask_mod, bool[] differentiated) -> (Tensor, Tensor, Tensor, Tensor[])")
FORWARD = torch.ops.supa_emu.flex_attention.default
BACKWARD = torch.ops.supa_emu.flex_attention_backward.default


def graph_source(graph_module: torch.fx.GraphModule) -> str:
    """The Python source a kernel rebuilds `graph_module` from (its `forward`, taking no attributes)."""
    attributes = [node.target for node in graph_module.graph.nodes if node.op == "get_attr"]
    if attributes:
        raise NotImplementedError(f"flex attention on supa: a score_mod or mask_mod graph that holds tensors "
                                  f"({', '.join(attributes)}) is not supported; pass them as captured tensors")
    return graph_module.code


def _on_host(*args, **kwargs) -> torch.device:
    return torch.device("cpu")


@functools.lru_cache(maxsize=256)
def _function(source: str):
    namespace = {name: builtin.obj for name, builtin in _custom_builtins.items()}
    namespace["torch"] = torch
    # The kernel computes on host tensors: a tensor the graph makes (`full(..., device=supa:0)`, a
    # mask's True) is made there too.
    namespace["device"] = _on_host
    exec(compile(source, "<supa flex attention graph>", "exec"), namespace)
    return functools.partial(namespace["forward"], None)


def _dense_layout(size, like: torch.Tensor, dtype, device) -> torch.Tensor:
    """An empty tensor of `size`, dense, its dimensions in the memory order of `like`'s."""
    order = sorted(range(like.dim()), key=lambda d: -like.stride(d))
    return torch.empty_permuted(size, order, dtype=dtype, device=device)


def _forward_results(query, key, value):
    batch, heads, length, _ = query.shape
    logsumexp = torch.empty(batch, heads, length, dtype=torch.float32, device=query.device)
    max_scores = torch.empty(batch, heads, length, dtype=torch.float32, device=query.device)
    out = _dense_layout((batch, heads, length, value.shape[-1]), query, query.dtype, query.device)
    return out, logsumexp, max_scores


def _backward_results(query, key, value):
    batch = query.shape[0]
    grad_query = _dense_layout(query.shape, query, query.dtype, query.device)
    grad_value = _dense_layout((batch, *value.shape[1:]), value, value.dtype, value.device)
    grad_key = _dense_layout((batch, *key.shape[1:]), key, key.dtype, key.device)
    return grad_query, grad_key, grad_value


def _buffer_grads(score_mod_buffers, differentiated) -> list:
    """The card's float32 gradient accumulators of the captured buffers the joint graph differentiates."""
    return [torch.empty(b.shape, dtype=torch.float32, device=b.device)
            for b, needed in zip(score_mod_buffers, differentiated) if needed]


def _in_order(tensors, scalars, positions) -> list:
    """A graph's captures as it takes them: the tensors with the integers at their positions."""
    captures = list(tensors)
    for position, scalar in zip(positions, scalars):  # positions ascend: each lands where it belongs
        captures.insert(position, scalar)
    return captures


@torch.library.register_fake("supa_emu::flex_attention", lib=_LIB)
def _forward_fake(query, key, value, score_mod_buffers, score_mod_scalars, score_mod_scalar_positions,
                  mask_mod_buffers, mask_mod_scalars, mask_mod_scalar_positions, scale, score_mod, mask_mod):
    return _forward_results(query, key, value)


@torch.library.register_fake("supa_emu::flex_attention_backward", lib=_LIB)
def _backward_fake(query, key, value, logsumexp, delta, grad_out, grad_logsumexp, score_mod_buffers,
                   score_mod_scalars, score_mod_scalar_positions, mask_mod_buffers, mask_mod_scalars,
                   mask_mod_scalar_positions, scale, score_mod, joint, mask_mod, differentiated):
    score_mod_buffers = _in_order(score_mod_buffers, score_mod_scalars, score_mod_scalar_positions)
    grad_query, grad_key, grad_value = _backward_results(query, key, value)
    if key.shape[0] != query.shape[0]:
        grad_key, grad_value = grad_key.sum(0, keepdim=True), grad_value.sum(0, keepdim=True)
    grads = [torch.empty_like(b, memory_format=torch.contiguous_format)
             for b, needed in zip(score_mod_buffers, differentiated) if needed]
    return grad_query, grad_key, grad_value, grads


@torch.library.impl("supa_emu::flex_attention", "PrivateUse1", lib=_LIB)
def _forward(query, key, value, score_mod_buffers, score_mod_scalars, score_mod_scalar_positions, mask_mod_buffers,
             mask_mod_scalars, mask_mod_scalar_positions, scale, score_mod, mask_mod):
    score_mod_buffers = _in_order(score_mod_buffers, score_mod_scalars, score_mod_scalar_positions)
    mask_mod_buffers = _in_order(mask_mod_buffers, mask_mod_scalars, mask_mod_scalar_positions)
    out, logsumexp, max_scores = _forward_results(query, key, value)
    results = [out, logsumexp, max_scores]
    if _skip(results):
        return tuple(results)
    with _host_work():
        _compute_forward(query, key, value, score_mod_buffers, mask_mod_buffers, scale, score_mod, mask_mod,
                         results)
    return tuple(results)


def _compute_forward(query, key, value, score_mod_buffers, mask_mod_buffers, scale, score_mod, mask_mod, results):
    blocks = _Blocks(query, key, value, score_mod_buffers, mask_mod_buffers, scale, score_mod, mask_mod)
    host_out, host_lse, host_max = (_host(t) for t in results)
    for rows in blocks.rows():
        _, post = blocks.scores(rows)
        lse = post.logsumexp(dim=-1)
        lse = torch.where(torch.all(post == -math.inf, dim=-1), -math.inf, lse)  # fully masked rows
        host_lse[:, :, rows] = lse / math.log(2)  # the kernels' log-sum-exp is in base 2
        host_max[:, :, rows] = post.amax(dim=-1) / math.log(2)
        weights = torch._safe_softmax(post, dim=-1).to(query.dtype)
        host_out[:, :, rows] = blocks.per_query_head(weights, blocks.value.to(query.dtype))


@torch.library.impl("supa_emu::flex_attention_backward", "PrivateUse1", lib=_LIB)
def _backward(query, key, value, logsumexp, delta, grad_out, grad_logsumexp, score_mod_buffers, score_mod_scalars,
              score_mod_scalar_positions, mask_mod_buffers, mask_mod_scalars, mask_mod_scalar_positions, scale,
              score_mod, joint, mask_mod, differentiated):
    score_mod_buffers = _in_order(score_mod_buffers, score_mod_scalars, score_mod_scalar_positions)
    mask_mod_buffers = _in_order(mask_mod_buffers, mask_mod_scalars, mask_mod_scalar_positions)
    grad_query, grad_key, grad_value = _backward_results(query, key, value)
    accumulators = _buffer_grads(score_mod_buffers, differentiated)
    results = [grad_query, grad_key, grad_value, *accumulators]
    if not _skip(results):
        with _host_work():
            _compute_backward(query, key, value, logsumexp, delta, grad_out, grad_logsumexp, score_mod_buffers,
                              mask_mod_buffers, scale, score_mod, joint, mask_mod, results)
    if key.shape[0] != query.shape[0]:  # keys broadcast over the batch: summed after the kernel, as on a card
        grad_key, grad_value = grad_key.sum(0, keepdim=True), grad_value.sum(0, keepdim=True)
    grads = [g if g.dtype == b.dtype else g.to(b.dtype)
             for g, b in zip(accumulators, [b for b, needed in zip(score_mod_buffers, differentiated) if needed])]
    return grad_query, grad_key, grad_value, grads


def _compute_backward(query, key, value, logsumexp, delta, grad_out, grad_logsumexp, score_mod_buffers,
                      mask_mod_buffers, scale, score_mod, joint, mask_mod, results):
    blocks = _Blocks(query, key, value, score_mod_buffers, mask_mod_buffers, scale, score_mod, mask_mod)
    host_grad_query, *_ = (_host(t) for t in results)
    accumulators = [torch.zeros(t.shape, dtype=torch.float32) for t in results[1:]]  # dk, dv, buffer grads
    joint = blocks.vmapped(_function(joint), prefix=(0,), suffix=(0,) + blocks.score_suffix,
                           out_dims=[0, None, None, None, None] + [None] * len(blocks.score_buffers))
    lse = _host(logsumexp) * math.log(2)
    grad_lse = None if grad_logsumexp is None else _host(grad_logsumexp) / math.log(2)
    host_delta, host_grad_out, host_query = _host(delta), _host(grad_out), _host(query)
    for rows in blocks.rows():
        scores, post = blocks.scores(rows)
        row_lse = lse[:, :, rows].unsqueeze(-1)
        weights = torch.where(row_lse == -math.inf, 0, torch.exp(post - row_lse))
        block_grad_out = host_grad_out[:, :, rows]
        accumulators[1] += blocks.per_key_head(weights.to(query.dtype), block_grad_out)
        grad_weights = blocks.per_query_head(block_grad_out.to(weights.dtype), blocks.value.to(weights.dtype),
                                             transpose=True)
        grad_score_mod = grad_weights - host_delta[:, :, rows].unsqueeze(-1)
        if grad_lse is not None:
            grad_score_mod = grad_score_mod + grad_lse[:, :, rows].unsqueeze(-1)
        grad_score_mod = weights * grad_score_mod
        del weights, grad_weights
        with TransformGetItemToIndex():
            grad_scores, _, _, _, _, *buffer_grads = joint(scores, *blocks.indices(rows), grad_score_mod,
                                                           *blocks.score_buffers)
        grad_scores = torch.where(blocks.mask(rows), (grad_scores * scale).to(query.dtype), 0)
        host_grad_query[:, :, rows] = blocks.per_query_head(grad_scores, blocks.key.to(query.dtype))
        accumulators[0] += blocks.per_key_head(grad_scores, host_query[:, :, rows])
        for accumulator, grad in zip(accumulators[2:], [g for g in buffer_grads if g is not None]):
            accumulator += grad
    for result, accumulator in zip(results[1:], accumulators):
        _host(result).copy_(accumulator)


def _plain_dispatch_exclusions():
    """The dispatch keys a thread excludes outside any operator (a fresh thread's)."""
    found = []
    thread = threading.Thread(target=lambda: found.append(torch._C._dispatch_tls_local_exclude_set()))
    thread.start()
    thread.join()
    return found[0]


_PLAIN_EXCLUSIONS = _plain_dispatch_exclusions()


@contextlib.contextmanager
def _host_work():
    """A kernel's host computation as plain code: a kernel runs below autograd and functorch, whose
    dispatch keys are excluded there, and vmap (score_mod's batching) needs them; no dispatch mode of
    the program sees the kernel's own operators."""
    include = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(include, _PLAIN_EXCLUSIONS), _disable_current_modes(), torch.no_grad():
        yield


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over a card tensor's memory (no copy); host tensors and integers as they are."""
    on_card = isinstance(tensor, torch.Tensor) and tensor.device.type == DEVICE_TYPE
    return process_state.core()._host_view(tensor) if on_card else tensor


def _skip(results) -> bool:
    """Shapes mode: the results hold values the plan did not compute, and nothing is computed."""
    if shapes.mode() != "shapes":
        return False
    process_state.core()._shapes_note_values(results, True)
    return True


class _Blocks:
    """One kernel call's operands on the host, and flex attention's dense definition for a block of
    query rows: scores of the block's queries against every key, score_mod and mask_mod applied to the
    block's own (batch, head, query, key) indices."""

    def __init__(self, query, key, value, score_mod_buffers, mask_mod_buffers, scale, score_mod, mask_mod):
        from torch.nn.attention.flex_attention import _vmap_for_bhqkv

        self.vmapped = _vmap_for_bhqkv
        self.working = torch.float64 if query.dtype == torch.float64 else torch.float32
        self.query = _host(query)
        batch, self.heads, self.length, _ = query.shape
        # Keys and values broadcast over the batch and are shared by groups of query heads (GQA).
        self.key = _host(key).expand(batch, *key.shape[1:]).to(self.working)
        self.value = _host(value).expand(batch, *value.shape[1:]).to(self.working)
        self.group = self.heads // key.shape[1]
        self.scale = scale
        self.score_buffers = tuple(_host(b) for b in score_mod_buffers)  # integers stay integers
        self.mask_buffers = tuple(_host(b) for b in mask_mod_buffers)
        self.score_suffix = (None,) * len(self.score_buffers)
        self.score_mod = _vmap_for_bhqkv(_function(score_mod), prefix=(0,), suffix=self.score_suffix)
        self.mask_mod = _vmap_for_bhqkv(_function(mask_mod), prefix=(), suffix=(None,) * len(self.mask_buffers))
        self.batch = torch.arange(batch)
        self.head = torch.arange(self.heads)
        self.key_index = torch.arange(key.shape[-2])
        self.block_rows = max(1, BLOCK_SCORE_BYTES // max(1, batch * self.heads * key.shape[-2] * 4))

    def rows(self):
        for start in range(0, self.length, self.block_rows):
            yield slice(start, min(start + self.block_rows, self.length))

    def indices(self, rows: slice):
        return self.batch, self.head, torch.arange(rows.start, rows.stop), self.key_index

    def mask(self, rows: slice) -> torch.Tensor:
        with TransformGetItemToIndex():
            return self.mask_mod(*self.indices(rows), *self.mask_buffers)

    def scores(self, rows: slice):
        """(scaled scores, scores after score_mod and mask_mod) of the block, in working precision."""
        scores = self.per_query_head(self.query[:, :, rows].to(self.working), self.key, transpose=True)
        scores = (scores * self.scale).to(self.working)
        with TransformGetItemToIndex():
            post = torch.where(self.mask(rows), self.score_mod(scores, *self.indices(rows), *self.score_buffers),
                               torch.tensor(-math.inf, dtype=self.working))
        return scores, post

    def per_query_head(self, rows: torch.Tensor, kv: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        """rows (B, Hq, r, n) @ kv (B, Hkv, L, d) (or its transpose) of each query head's key head."""
        batch, _, count, width = rows.shape
        grouped = rows.reshape(batch, -1, self.group, count, width)
        kv = kv.unsqueeze(2).transpose(-2, -1) if transpose else kv.unsqueeze(2)
        return (grouped @ kv).flatten(1, 2)

    def per_key_head(self, rows: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """Sum over each key head's query heads and the block's rows of rows^T @ other, in float32:
        rows (B, Hq, r, L), other (B, Hq, r, d) -> (B, Hkv, L, d)."""
        batch, _, count, width = rows.shape
        rows = rows.reshape(batch, -1, self.group * count, width).float()
        other = other.reshape(batch, -1, self.group * count, other.shape[-1]).float()
        return rows.transpose(-2, -1) @ other
