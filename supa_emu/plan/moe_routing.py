"""The routing a plan assumes for MoE layers (`--moe-routing`): applied where the router chooses experts.

An expert-parallel MoE layer sends each rank's tokens to the ranks that hold their experts, and the
sizes of that exchange (the capacity DeepSpeed's gate computes without dropping tokens, the splits
of a token-choice all_to_all_single, the rows each local expert multiplies) follow from which
experts the router chose: values a planned rank does not have (shapes mode never computes the
router's scores; under the uniform-rank rule every rank would route as this one does). So the plan
states an assumption and applies it at the router's choice:

- balanced (the default): route i of token t goes to expert (t * K + i) mod E, so every expert
  receives an even share of every rank's tokens (torchtitan's own forced balance, and below
  DeepSpeed's capacity);
- worst: every rank routes each token's K choices to the experts of this rank, starting with its
  first local expert (the rest to the next rank's when K exceeds the experts per rank), so this
  rank receives all it can: a gate that drops tokens caps what each expert takes at its capacity;
- router: the program's router decides (compute mode only; an uneven exchange is flagged).

The choice is made by the router's own top-k (`torch.topk`) or arg-max (`torch.argmax`, DeepSpeed's
top-1 and top-2 gates: the n-th call is route n) over the expert dimension: the operator runs as in
the program (its results are allocated as the program's are), then its indices are overwritten in
place with the assumed experts and a top-k's values gathered from its input into their own buffer,
keeping their version counters: to autograd and to selective activation checkpointing (which caches
a top-k's results and refuses them mutated) they are the operator's results, so a top-k's backward
sends its gradients to the scores of the experts chosen.
Everything after it, counts, the exchange of counts, splits and capacity, comes from the program's
own code. Routers are recognised by their class, when a module registers them as a submodule
(a module registration hook: no patch of any package): DeepSpeed's `TopKGate` and torchtitan's
`TokenChoiceTopKRouter` (or a class of one of these names with the same attributes). The expert-parallel
group that says which experts are this rank's is the gate's `ep_group` (DeepSpeed), its owner's
`ep_group`, or its owner's `routed_experts.token_dispatcher.ep_mesh` (torchtitan).
"""

import weakref
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

BALANCED, WORST, ROUTER = "balanced", "worst", "router"
ROUTINGS = (BALANCED, WORST, ROUTER)

_routing: Optional[str] = None
_calls: Dict[str, int] = {}
_hooked = weakref.WeakSet()
_active: List[tuple] = []  # (router, its _AssumedChoice), innermost last


def _deepspeed_gate(gate, owner):
    return gate.wg.out_features, gate.k, gate.ep_group


def _token_choice_router(router, owner):
    return router.num_experts, router.top_k, _owner_group(owner)


# Router class name -> (the attributes it must have, what gives (experts, top-k, expert-parallel group
# or None) of a router and its owner).
ROUTERS = {"TopKGate": (("wg", "k", "ep_group"), _deepspeed_gate),
           "TokenChoiceTopKRouter": (("num_experts", "top_k"), _token_choice_router)}


def _owner_group(owner):
    if owner is None:
        return None
    group = getattr(owner, "ep_group", None)
    if group is not None:
        return group
    dispatcher = getattr(getattr(owner, "routed_experts", None), "token_dispatcher", None)
    mesh = getattr(dispatcher, "ep_mesh", None)
    return mesh.get_group() if mesh is not None else None


def install(routing: str):
    """From now on in this process (a planned rank), routers registered in a module choose by `routing`;
    returns the hook's handle (None for `router`), whose `remove()` stops that for routers registered later."""
    global _routing
    if routing not in ROUTINGS:
        raise ValueError(f"--moe-routing {routing}: accepted values: {', '.join(ROUTINGS)}")
    _routing = routing
    if routing == ROUTER:
        return None
    return torch.nn.modules.module.register_module_module_registration_hook(_on_registration)


def summary() -> dict:
    """{assumed, routers: {class: forward calls whose choice was the assumed one}} for the rank's record."""
    return {"assumed": _routing, "routers": dict(_calls)}


def _on_registration(owner, name, module):
    attributes, describe = ROUTERS.get(type(module).__name__, ((), None))
    if describe is None or module in _hooked or not all(hasattr(module, a) for a in attributes):
        return None
    _hooked.add(module)
    owner_ref = weakref.ref(owner)
    module.register_forward_pre_hook(lambda router, args: _enter(router, describe(router, owner_ref())))
    module.register_forward_hook(lambda router, args, output: _leave(router), always_call=True)
    return None


def _enter(router, described) -> None:
    experts, top_k, group = described
    ep_rank, ep_size = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    kind = type(router).__name__
    _calls[kind] = _calls.get(kind, 0) + 1
    choice = _AssumedChoice(assumed_experts(_routing, experts, top_k, ep_rank, ep_size), experts)
    choice.__enter__()
    _active.append((router, choice))


def _leave(router) -> None:
    if _active and _active[-1][0] is router:  # not when its pre-hook failed before entering
        _active.pop()[1].__exit__(None, None, None)


def assumed_experts(routing: str, experts: int, top_k: int, ep_rank: int, ep_size: int):
    """f(tokens) -> the [tokens, top_k] int64 experts (host) each token is routed to under `routing`."""
    if top_k > experts:
        raise ValueError(f"a router choosing {top_k} of {experts} experts")
    if routing == BALANCED:
        return lambda tokens: (torch.arange(tokens * top_k) % experts).view(tokens, top_k)
    first = ep_rank * (experts // ep_size)  # this rank's first expert
    routes = (first + torch.arange(top_k)) % experts
    return lambda tokens: routes.expand(tokens, top_k)


def _local(tensor):
    """A DTensor's local shard (a router under tensor or sequence parallelism), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class _AssumedChoice(TorchFunctionMode):
    """While a router runs: its top-k / arg-max over the expert dimension choose the assumed experts."""

    _TOPK = {torch.topk, torch.Tensor.topk}
    _ARGMAX = {torch.argmax, torch.Tensor.argmax}

    def __init__(self, experts_of, experts: int):
        super().__init__()
        self._experts_of, self._experts, self._argmax_calls = experts_of, experts, 0

    def _over_experts(self, input, dim) -> bool:
        return (isinstance(input, torch.Tensor) and input.is_floating_point() and input.dim() >= 1
                and input.shape[-1] == self._experts and dim is not None and dim % input.dim() == input.dim() - 1)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        outputs = [t for t in (result if isinstance(result, tuple) else (result,)) if isinstance(t, torch.Tensor)]
        outputs += [_local(t) for t in outputs if _local(t) is not t]
        versions = [t._version for t in outputs]
        with torch.no_grad():
            self._assume(func, args, kwargs, result)
        # As if the operator had produced the assumed choice (see above).
        torch._C._autograd._unsafe_set_version_counter(tuple(outputs), tuple(versions))
        return result

    def _assume(self, func, args, kwargs, result) -> None:
        if func in self._TOPK:
            input, dim = args[0], (args[2] if len(args) > 2 else kwargs.get("dim", -1))
            largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
            if self._over_experts(input, dim) and largest and "out" not in kwargs:
                values, indices = _local(result.values), _local(result.indices)
                chosen = self._experts_of(indices.numel() // max(indices.shape[-1], 1))
                if indices.shape[-1] <= chosen.shape[1]:  # the router's K routes (or fewer), not another top-k
                    indices.copy_(chosen[:, :indices.shape[-1]].reshape(indices.shape))
                    torch.gather(_local(input).detach(), -1, indices, out=values.detach())
        elif func in self._ARGMAX:
            input, dim = args[0], (args[1] if len(args) > 1 else kwargs.get("dim"))
            if self._over_experts(input, dim) and "out" not in kwargs:
                indices = _local(result)
                chosen = self._experts_of(indices.numel())
                if self._argmax_calls < chosen.shape[1]:
                    indices.copy_(chosen[:, self._argmax_calls].reshape(indices.shape))
                self._argmax_calls += 1
