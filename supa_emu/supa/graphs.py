"""SUPA graphs: capture a sequence of supa operations once and replay it.

`SUPAGraph` is PyTorch's generic accelerator graph for the supa device; the native core
records the operations run on supa tensors during capture and re-runs them on `replay()`,
reading and writing the same tensors (so inputs are fed by copying into the captured ones).
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from supa_emu.device_type import DEVICE_TYPE

from . import _sanitizer_switch
from ._runtime import _lazy_init, _native, current_device, synchronize
from .memory import empty_cache
from .streams import current_stream

__all__ = ["is_current_stream_capturing", "graph_pool_handle", "SUPAGraph", "graph",
           "make_graphed_callables"]

_CAPTURE_MODES = ("global", "thread_local", "relaxed")
_MempoolId = tuple[int, int]


def is_current_stream_capturing() -> bool:
    """True while the current stream of the current device is being captured into a graph."""
    return bool(_native()._is_current_stream_capturing())


def graph_pool_handle() -> _MempoolId:
    """A fresh memory-pool token (n, 0) that several graphs can share via `capture_begin(pool=...)`.

    The core numbers these from the same counter as the pools of graphs captured without one.
    """
    _lazy_init()
    return tuple(_native()._graph_pool_handle())


class SUPAGraph(torch._C._acceleratorGraph):
    """A captured SUPA graph. Build with `SUPAGraph()`, fill it between `capture_begin()` and
    `capture_end()` (or with `torch.supa.graph(g)`), then `replay()` it any number of times."""

    def __init__(self, keep_graph: bool = False) -> None:
        _lazy_init()
        super().__init__(keep_graph)
        self._generators: list[torch.Generator] = []

    def register_generator_state(self, generator: torch.Generator) -> None:
        """Keep `generator` graph-safe in this graph, as the current device's default generator is:
        random calls captured with it take their numbers from its (seed, offset) at each replay,
        and each replay advances its offset. Raises RuntimeError while a graph captures."""
        if is_current_stream_capturing():
            raise RuntimeError("Cannot register the state during capturing stage.")
        if generator.device.type != DEVICE_TYPE:
            raise RuntimeError(f"Expected a {DEVICE_TYPE} generator, got one of device {generator.device}")
        if not any(g is generator for g in self._generators):
            self._generators.append(generator)

    def capture_begin(self, pool: Optional[_MempoolId] = None, capture_error_mode: str = "global") -> None:
        """Start capturing the current stream's work.

        `pool` shares a memory pool with other graphs (see `graph_pool_handle`, `pool()`).
        `capture_error_mode` is "global", "thread_local" or "relaxed"; anything else raises
        RuntimeError.
        """
        if capture_error_mode not in _CAPTURE_MODES:
            raise RuntimeError(
                "Unknown capture error mode. Expected `global`, `thread_local`, or `relaxed`, "
                f"got {capture_error_mode}")
        super().capture_begin(pool=pool, capture_error_mode=capture_error_mode)
        for generator in self._generators:
            _native()._register_generator_with_capture(generator)
        sanitizer = _sanitizer_switch.active()
        if sanitizer is not None:
            sanitizer.graph_capture_begin(self)

    def capture_end(self) -> None:
        """Finish the capture started by `capture_begin`; the graph becomes replayable."""
        super().capture_end()
        sanitizer = _sanitizer_switch.active()
        if sanitizer is not None:
            sanitizer.graph_capture_end(self)

    def replay(self) -> None:
        """Run the captured work again on the tensors it was captured with."""
        super().replay()
        sanitizer = _sanitizer_switch.active()
        if sanitizer is not None:
            sanitizer.graph_replayed(self)

    def reset(self) -> None:
        """Drop the captured graph so this object can capture again."""
        super().reset()

    def pool(self) -> _MempoolId:
        """The token of this graph's memory pool, to pass to another graph's `capture_begin`."""
        return tuple(super().pool())

    def enable_debug_mode(self) -> None:
        """Keep enough information after capture for `debug_dump`."""
        super().enable_debug_mode()

    def debug_dump(self, debug_path: str) -> None:
        """Write a description of the captured graph to `debug_path` (needs `enable_debug_mode`)."""
        super().debug_dump(debug_path)


class graph:
    """Context manager capturing the block into `supa_graph`.

    Entry synchronises the device, collects garbage and empties the cache (so the capture
    starts from a quiet allocator), switches to `stream` (default: a side stream shared by all
    `graph` contexts) and begins capture; exit ends capture and restores the stream.
    """

    default_capture_stream: Optional["torch.supa.Stream"] = None

    def __init__(self, supa_graph: SUPAGraph, pool: Optional[_MempoolId] = None,
                 stream: Optional[torch.Stream] = None, capture_error_mode: str = "global") -> None:
        from .streams import Stream, StreamContext

        if self.__class__.default_capture_stream is None:
            self.__class__.default_capture_stream = Stream()
        self.pool: tuple[_MempoolId, ...] = () if pool is None else (pool,)
        self.capture_stream = stream if stream is not None else self.__class__.default_capture_stream
        self.stream_ctx = StreamContext(self.capture_stream)
        self.supa_graph = supa_graph
        self.capture_error_mode = capture_error_mode

    def __enter__(self) -> None:
        synchronize()
        gc.collect()
        empty_cache()
        self.stream_ctx.__enter__()
        self.supa_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode)

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self.supa_graph.capture_end()
        finally:
            self.stream_ctx.__exit__(*exc_info)


# ---------------------------------------------------------------------------------------------
# make_graphed_callables

def _check_graphable(func: Any, flat_args: Sequence[Any]) -> None:
    if isinstance(func, torch.nn.Module):
        if func._backward_hooks or func._forward_hooks or func._forward_pre_hooks:
            raise AssertionError(
                "Modules passed to make_graphed_callables must not have hooks registered yet "
                "(hooks may be added to the returned module afterwards).")
        if any(b.requires_grad for b in func.buffers()):
            raise AssertionError(
                "Only parameters of a Module passed to make_graphed_callables may require grad; "
                "all buffers must have requires_grad=False.")
    if not all(isinstance(a, torch.Tensor) for a in flat_args):
        raise AssertionError("sample_args passed to make_graphed_callables may contain only Tensors.")


def _grads_of(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
              grad_outputs: Sequence[torch.Tensor], allow_unused: bool) -> tuple[Optional[torch.Tensor], ...]:
    diff_outputs = tuple(o for o in outputs if o.requires_grad)
    diff_inputs = tuple(i for i in inputs if i.requires_grad)
    if not diff_outputs or not diff_inputs:
        return ()
    return torch.autograd.grad(diff_outputs, diff_inputs, grad_outputs=tuple(grad_outputs),
                               only_inputs=True, allow_unused=allow_unused)


class _GraphedCallable:
    """One callable's captured forward and backward graphs and their static tensors."""

    def __init__(self, num_user_args: int, static_inputs: tuple[torch.Tensor, ...]) -> None:
        self.num_user_args = num_user_args
        self.static_inputs = static_inputs
        self.fwd_graph = SUPAGraph()
        self.bwd_graph = SUPAGraph()
        self.static_outputs: tuple[torch.Tensor, ...] = ()
        self.output_spec: Any = None
        self.static_grad_outputs: tuple[Optional[torch.Tensor], ...] = ()
        self.static_grad_inputs: tuple[Optional[torch.Tensor], ...] = ()

    def autograd_function(self) -> type[torch.autograd.Function]:
        captured = self

        class Graphed(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
                # Parameters are the captured tensors themselves; only user args need copying.
                for static, given in zip(captured.static_inputs[:captured.num_user_args], inputs):
                    if static.data_ptr() != given.data_ptr():
                        static.copy_(given)
                captured.fwd_graph.replay()
                return tuple(o.detach() for o in captured.static_outputs)

            @staticmethod
            @torch.autograd.function.once_differentiable
            def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
                for static, given in zip(captured.static_grad_outputs, grads):
                    if static is not None and given is not None and static.data_ptr() != given.data_ptr():
                        static.copy_(given)
                captured.bwd_graph.replay()
                return tuple(g.detach() if g is not None else None for g in captured.static_grad_inputs)

        return Graphed

    def functionalized(self, params: tuple[torch.Tensor, ...]) -> Callable[..., Any]:
        graphed = self.autograd_function()
        spec = self.output_spec

        def run(*user_args: Any) -> Any:
            flat_user_args, _ = tree_flatten(user_args)
            outputs = graphed.apply(*(tuple(flat_user_args) + params))
            return tree_unflatten(list(outputs), spec)

        return run


def make_graphed_callables(callables: Union[Callable[..., Any], tuple[Callable[..., Any], ...]],
                           sample_args: Union[tuple[torch.Tensor, ...], tuple[tuple[torch.Tensor, ...], ...]],
                           num_warmup_iters: int = 3, allow_unused_input: bool = False,
                           pool: Optional[_MempoolId] = None) -> Any:
    """Return graphed versions of `callables` (functions or Modules) for the given sample inputs.

    Each callable is warmed up `num_warmup_iters` times on a side stream, its forward pass is
    captured into one graph and its backward pass (for inputs and parameters requiring grad)
    into another; calling the result replays them through an autograd Function. Modules get a
    new `forward` that uses the graphs only in the training mode they were captured in.
    The graphed call requires inputs with the sample args' shapes, dtypes and devices.

    Raises RuntimeError when autocast with caching is enabled, AssertionError for Modules with
    hooks or trainable buffers and for non-Tensor sample args.
    """
    if torch.is_autocast_enabled(DEVICE_TYPE) and torch.is_autocast_cache_enabled():
        raise RuntimeError(
            "make_graphed_callables does not support the autocast caching. Please set `cache_enabled=False`.")
    from .streams import Stream, stream as stream_ctx

    just_one = not isinstance(callables, tuple)
    if just_one:
        callables = (callables,)
        sample_args = (sample_args,)

    captures: list[_GraphedCallable] = []
    all_params: list[tuple[torch.Tensor, ...]] = []
    for func, args in zip(callables, sample_args):
        flat_args, _ = tree_flatten(args)
        _check_graphable(func, flat_args)
        params = tuple(func.parameters()) if isinstance(func, torch.nn.Module) else ()
        all_params.append(params)
        captures.append(_GraphedCallable(len(flat_args), tuple(flat_args) + params))

    mempool = graph_pool_handle() if pool is None else pool

    # Warm up on a side stream so lazy initialisation (workspaces, autograd state) happens
    # outside the capture.
    synchronize()
    with stream_ctx(Stream()):
        for func, args, cap in zip(callables, sample_args, captures):
            for _ in range(num_warmup_iters):
                outputs, _ = tree_flatten(func(*args))
                # Zeros, not empty_like: the warm-up's backward really reads them (the memory
                # checker's initcheck would say so), though its results are thrown away.
                grads = _grads_of(outputs, cap.static_inputs,
                                  [torch.zeros_like(o) for o in outputs if o.requires_grad],
                                  allow_unused_input)
                del outputs, grads
    synchronize()

    # Forward graphs in call order.
    for func, args, cap in zip(callables, sample_args, captures):
        with graph(cap.fwd_graph, pool=mempool):
            outputs = func(*args)
        flat_outputs, cap.output_spec = tree_flatten(outputs)
        cap.static_outputs = tuple(flat_outputs)

    # Backward graphs in reverse order, as autograd would run them.
    for cap in reversed(captures):
        grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None for o in cap.static_outputs)
        with graph(cap.bwd_graph, pool=mempool):
            grads = _grads_of(cap.static_outputs, cap.static_inputs,
                              [g for g in grad_outputs if g is not None], allow_unused_input)
        grad_iter = iter(grads)
        cap.static_grad_outputs = grad_outputs
        cap.static_grad_inputs = tuple(next(grad_iter) if i.requires_grad else None for i in cap.static_inputs)

    results = []
    for func, cap, params in zip(callables, captures, all_params):
        run = cap.functionalized(params)
        if isinstance(func, torch.nn.Module):
            func.forward = _mode_aware_forward(func, run, func.forward, func.training)
            results.append(func)
        else:
            results.append(run)
    return results[0] if just_one else tuple(results)


def _mode_aware_forward(module: torch.nn.Module, graphed: Callable[..., Any],
                        eager: Callable[..., Any], captured_training: bool) -> Callable[..., Any]:
    # The graphs hold the train-or-eval behaviour they were captured with (dropout, batchnorm
    # statistics), so the other mode falls back to the original forward.
    def forward(*args: Any) -> Any:
        if module.training == captured_training:
            return graphed(*args)
        return eager(*args)

    return forward
