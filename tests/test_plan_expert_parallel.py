"""The planner on expert-parallel MoE jobs: the routing it assumes (`--moe-routing`), exact against the real job
forced to that routing.

How many tokens each rank's experts receive decides the buffers an MoE layer's all_to_alls fill,
and it follows from the router's choice, which a plan cannot know. The plan assumes a routing and
applies it at the router's choice (supa_emu/plan/moe_routing.py); the reference is the real job
whose router is forced to the same routing, run as N torchrun processes recorded with
SUPA_PLAN_RECORD: DeepSpeed's MoE layer (top-1 and top-2 gates without dropping tokens, and top-1
with its fixed capacity; tests/data/plan/deepspeed_moe.py) and a token-choice MoE in torchtitan's
style (top-2, counts exchanged, uneven all_to_all_single; tests/data/plan/moe_token_choice.py), at
EP = 2, 4 and 8, planned in both modes: each played rank's peak allocated and reserved bytes equal the
real rank's to the byte, per section, and its collective lists are equal.
"""

import pytest
import torch
from test_plan import MODES, SCRIPTS, plan, real_run

from supa_emu.plan import moe_routing, report
from supa_emu.plan.__main__ import main as plan_main

SCRIPTS_BY_NAME = {"deepspeed": SCRIPTS / "deepspeed_moe.py", "token_choice": SCRIPTS / "moe_token_choice.py"}
WORLDS = (2, 4, 8)

pytestmark = pytest.mark.emulation_only


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """(script, world, forced route) -> the real job's records; (script, world, mode, routing) -> the plan."""
    real_jobs, plans = {}, {}

    def real(name, world, route):
        if (name, world, route) not in real_jobs:
            out = tmp_path_factory.mktemp(f"{name}-{world}-real")
            real_jobs[name, world, route] = real_run([str(SCRIPTS_BY_NAME[name]), route], world, out)
        return real_jobs[name, world, route]

    def planned(name, world, mode, routing):
        if (name, world, mode, routing) not in plans:
            out = tmp_path_factory.mktemp(f"{name}-{world}-{mode}-{routing}") / "plan.json"
            # The script runs with its own router: the plan's assumption alone decides the routing.
            plans[name, world, mode, routing] = plan([str(SCRIPTS_BY_NAME[name]), "router"], world, out, "--mode",
                                                     mode, "--moe-routing", routing, "--no-time")[0]
        return plans[name, world, mode, routing]
    return real, planned


def _figures(record: dict) -> tuple:
    return (record["peak_allocated"], record["peak_reserved"], record["collectives"],
            [(s["name"], s["peak_allocated"], s["peak_reserved"], s["collectives"]) for s in record["sections"]])


def _assert_same_as_real(planned: dict, real: dict, ranks, routing: str, router: str) -> None:
    assert planned["moe_routing"] == routing
    for rank in ranks:
        entry = planned["ranks"][str(rank)]
        assert entry["failure"] is None, entry["failure"]
        assert entry["moe_routing"]["assumed"] == routing and entry["moe_routing"]["routers"][router] > 0
        assert _figures(entry) == _figures(real[rank]), f"rank {rank}"
        # The all_to_alls were even or followed the assumption: nothing uneven was guessed.
        assert not [n for n in entry["value_dependent"] if "uneven" in n["what"]]


ROUTER_CLASS = {"deepspeed": "TopKGate", "token_choice": "TokenChoiceTopKRouter"}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(SCRIPTS_BY_NAME))
def test_a_balanced_plan_matches_the_real_job_forced_to_balanced_routing(name, world, mode, jobs):
    real, planned = jobs
    _assert_same_as_real(planned(name, world, mode, "balanced"), real(name, world, "balanced"), (0, world - 1),
                         "balanced", ROUTER_CLASS[name])


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(SCRIPTS_BY_NAME))
def test_a_worst_case_plan_matches_the_real_job_that_routes_everything_to_that_rank(name, world, mode, jobs):
    real, planned = jobs
    last = world - 1
    worst, forced = planned(name, world, mode, "worst"), real(name, world, f"worst:{last}")
    # The played rank N-1 is the one every rank routes to. Under DeepSpeed's gate every rank then
    # holds the same buffers (the capacity is the group's largest count), so rank 0 matches too.
    _assert_same_as_real(worst, forced, (0, last) if name == "deepspeed" else (last,), "worst", ROUTER_CLASS[name])
    balanced = planned(name, world, mode, "balanced")
    for section_worst, section_balanced in zip(worst["ranks"][str(last)]["sections"],
                                               balanced["ranks"][str(last)]["sections"]):
        moved = {name: max(c["bytes"] for c in s["collectives"] if c["op"] == "all_to_all_single" and
                           c["dtype"] == "float32") for name, s in (("worst", section_worst),
                                                                    ("balanced", section_balanced))}
        if section_worst["name"] == "top1_drop":  # a fixed capacity: the same buffers whatever the routing
            assert moved["worst"] == moved["balanced"]
            assert section_worst["peak_allocated"] == section_balanced["peak_allocated"]
        else:  # this rank receives more than an even share, and holds more
            assert moved["worst"] > moved["balanced"]
            assert section_worst["peak_allocated"] > section_balanced["peak_allocated"]


@pytest.mark.slow
def test_the_programs_own_routing_is_planned_in_compute_mode_and_flagged_where_uneven(tmp_path):
    planned, result = plan([str(SCRIPTS_BY_NAME["token_choice"]), "router"], 2, tmp_path / "plan.json",
                           "--moe-routing", "router", "--no-time")
    entry = planned["ranks"]["1"]
    assert planned["moe_routing"] == "router" and entry["moe_routing"] == {"assumed": "router", "routers": {}}
    # Under the uniform-rank rule every rank would route as this one does: the splits are a guess, and say so.
    assert any(n["what"].startswith("all_to_all_single with uneven splits") for n in entry["value_dependent"])
    assert "MoE routing assumed" not in result.stdout


# ------------------------------------------------------------------------------------------------
# The assumption and the command (fast)
# ------------------------------------------------------------------------------------------------
def test_balanced_routing_gives_every_expert_an_even_share():
    experts = moe_routing.assumed_experts("balanced", 8, 2, ep_rank=1, ep_size=4)(64)
    assert experts.shape == (64, 2)
    assert (experts[:, 0] != experts[:, 1]).all()  # a token's choices are distinct experts
    assert experts.flatten().bincount(minlength=8).tolist() == [16] * 8


@pytest.mark.parametrize("top_k, expected", [(1, [6]), (2, [6, 7]), (3, [6, 7, 0])])
def test_worst_routing_sends_every_token_to_this_ranks_experts_first(top_k, expected):
    experts = moe_routing.assumed_experts("worst", 8, top_k, ep_rank=3, ep_size=4)(5)  # rank 3 holds experts 6, 7
    assert experts.tolist() == [expected] * 5


class TokenChoiceTopKRouter(torch.nn.Module):  # recognised by its class name, as torchtitan's
    def __init__(self, experts=8, top_k=2):
        super().__init__()
        self.num_experts, self.top_k = experts, top_k
        self.gate = torch.nn.Linear(16, experts)

    def forward(self, x):
        scores = torch.softmax(self.gate(x), dim=-1)
        top = scores.topk(2, dim=-1)  # another top-k over experts, of the router's K: also its choice
        _, experts = torch.topk(scores, k=self.top_k, dim=-1)
        _, first = torch.topk(x, k=3, dim=0)  # over tokens: not a choice of experts
        return top, experts, first


@pytest.fixture
def assumed():
    def install(routing):
        handle = moe_routing.install(routing)
        installed.append(handle)
    installed = []
    yield install
    for handle in installed:
        handle.remove()


@pytest.mark.parametrize("routing, expected", [("balanced", [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1], [2, 3]]),
                                               ("worst", [[0, 1]] * 6)])
def test_a_registered_router_chooses_the_assumed_experts_in_its_own_buffers(routing, expected, assumed):
    assumed(routing)
    owner = torch.nn.Module()
    owner.router = TokenChoiceTopKRouter()  # registered: hooked (no expert-parallel group: this rank is EP rank 0)
    x = torch.randn(6, 16)
    scores = torch.softmax(owner.router.gate(x), dim=-1)
    with torch.no_grad():
        top, experts, first = owner.router(x)
    assert experts.tolist() == top.indices.tolist() == expected
    assert torch.equal(top.values, scores.gather(-1, top.indices))  # the values of the assumed choice
    assert torch.equal(first, torch.topk(x, k=3, dim=0).indices)
    # To autograd the results are the operator's: its backward reaches the gate through the chosen scores.
    top, _, _ = owner.router(x)
    top.values.sum().backward()
    assert owner.router.gate.weight.grad.abs().sum() > 0
    assert moe_routing.summary()["routers"]["TokenChoiceTopKRouter"] >= 1
    unregistered = TokenChoiceTopKRouter()  # a router no module registered keeps its own choice
    assert torch.equal(unregistered(x)[1], torch.topk(torch.softmax(unregistered.gate(x), -1), 2).indices)


@pytest.mark.parametrize("options, error", [
    (["--moe-routing", "even"], "--moe-routing even: accepted values: balanced, worst, router"),
    (["--moe-routing", "router", "--mode", "shapes"], "--moe-routing router needs --mode compute"),
])
def test_a_bad_routing_is_a_one_line_error(options, error, capsys):
    assert plan_main(["--world-size", "2", *options, "--", str(SCRIPTS_BY_NAME["token_choice"]), "router"]) == 2
    err = capsys.readouterr().err
    assert error in err and err.count("\n") == 1


def test_the_table_names_the_routing_where_a_router_ran():
    record = {"capacity": 1 << 30, "peak_allocated": 1 << 20, "peak_reserved": 2 << 20, "peak_phase": "forward",
              "oom": False, "oom_events": [], "collectives": [], "value_dependent": [], "timeline": [],
              "failure": None, "moe_routing": {"assumed": "worst", "routers": {"TopKGate": 6}}}
    full = report.build(4, 4, "moe.py", [], {0: record, 3: record}, "shapes", "worst")
    assert full["moe_routing"] == "worst"
    assert ("MoE routing assumed: worst (routers that chose by it: rank 0: TopKGate 6x; rank 3: TopKGate 6x)"
            in report.text(full).splitlines())
    quiet = dict(record, moe_routing={"assumed": "balanced", "routers": {}})
    assert "MoE routing" not in report.text(report.build(4, 4, "mlp.py", [], {0: quiet}, "compute"))
