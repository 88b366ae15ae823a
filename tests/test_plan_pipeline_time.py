"""The pipeline's bubble in the planned step time: a point-to-point transfer between two played ranks
starts no earlier than both sides posted it (supa_emu/plan/p2p_time.py, time_model.py; the rules in
docs/time_on_the_card.md, "The model": point-to-point between played ranks).

Two schedules play their ranks' streams side by side (threads here, rank processes in a plan) and
exchange their posts through a plan directory; the expected times are worked out by hand from the
operators' own costs. Then the planner on a two-stage toy pipeline (tests/data/plan/pipeline_bubble.py):
with both stages played the later stage idles for the earlier one's forward, in both modes alike;
played alone (--rank 0) the earlier stage keeps its own time and says its peer was not played;
crossed waits fall back.
"""

import dataclasses
import json
import os
import pathlib
import sys
import threading
import time

import pytest
from harness import fresh_process
from test_plan_time import BIG, H100, SCRIPTS, t

from supa_emu.plan import collective_time, op_costs, p2p_time, time_model
from supa_emu.plan.plan_directory import PlanDirectory, Wait, message_name

NBYTES = 64 << 20  # one activation, within one host
SMALL = ([t("BFloat16", 1024, 1024), t("BFloat16", 1024, 1024)], [t("BFloat16", 1024, 1024)])
STEP = (time_model.MARK, -1, 0, 0, time_model.STEP_MARK, [], [])


def _op(ins_outs, stream=0):
    return (time_model.OP, 0, 0, stream, 0, *ins_outs)


def _mark(index, stream=0):
    return (time_model.MARK, -1, 0, stream, index, [], [])


def _transfer(op, source, destination, number=1):
    sends = op == "send"
    return time_model.Collective(op, NBYTES, 2, 1, "pp", True,
                                 p2p_time.Transfer("pp", source, destination, number, sends))


def _play_ranks(tmp_path, programs, played=(0, 1)):
    """Each rank's (entries, collective records) fed to its own schedule, side by side: the schedules."""
    PlanDirectory(str(tmp_path)).write_played(played, False)
    schedules = {rank: time_model.Schedule(dataclasses.replace(H100, launch_latency=0.0), host_op_s=0.0, rank=rank,
                                           peers=p2p_time.PeerPosts(str(tmp_path), rank, set(played), os.getppid()))
                 for rank in programs}
    failures = []

    def play(rank):
        try:
            schedules[rank].feed(programs[rank][0] + [STEP], ["aten::mm"], programs[rank][1])
        except BaseException as error:  # the peer then times its transfers alone rather than wait for ever
            failures.append(error)
        PlanDirectory(str(tmp_path)).mark_ended(rank)

    threads = [threading.Thread(target=play, args=(rank,)) for rank in programs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failures and not any(thread.is_alive() for thread in threads)
    return schedules


def _seconds(cost):
    return max(time_model.Schedule(H100).seconds(op_costs.cost("aten::mm", *cost)))


def _transfer_seconds():
    return collective_time.seconds("send", NBYTES, 2, 1, H100, 400)


def test_a_receive_waits_for_its_send_and_the_wait_is_idle(tmp_path):
    # stage 0: four products, then send; stage 1: receive, wait for it, one small product
    schedules = _play_ranks(tmp_path, {
        0: ([_op(BIG)] * 4 + [_mark(0), _mark(1)], [_transfer("send", 0, 1), time_model.Waited(0)]),
        1: ([_mark(0), _mark(1), _op(SMALL)], [_transfer("recv", 0, 1), time_model.Waited(0)])})
    forward, transfer, small = 4 * _seconds(BIG), _transfer_seconds(), _seconds(SMALL)
    sender, receiver = schedules[0].steps[0], schedules[1].steps[0]
    assert sender["seconds"] == pytest.approx(forward + transfer)
    assert receiver["seconds"] == pytest.approx(forward + transfer + small)
    assert receiver["split"]["idle"] == pytest.approx(forward)  # the bubble
    assert receiver["split"]["communication"] == pytest.approx(transfer)
    for schedule in schedules.values():
        assert schedule.report()["point_to_point"] == {"timed_with_peer": 1, "timed_alone": {}}


def test_a_channel_runs_its_transfers_in_order(tmp_path):
    # two sends posted at once, the receiver posting both at 0: the second starts when the first ends
    sends = [_transfer("send", 0, 1, 1), _transfer("send", 0, 1, 2)]
    receives = [_transfer("recv", 0, 1, 1), _transfer("recv", 0, 1, 2)]
    schedules = _play_ranks(tmp_path, {0: ([_op(BIG), _mark(0), _mark(1)], sends),
                                       1: ([_mark(0), _mark(1)], receives)})
    expected = _seconds(BIG) + 2 * _transfer_seconds()
    assert schedules[0].steps[0]["seconds"] == schedules[1].steps[0]["seconds"] == pytest.approx(expected)


def test_the_two_directions_of_a_pair_do_not_wait_for_each_other(tmp_path):
    # each rank sends first and receives second (a grouped exchange): both run at once
    schedules = _play_ranks(tmp_path, {
        0: ([_mark(0), _mark(1)], [_transfer("send", 0, 1), _transfer("recv", 1, 0)]),
        1: ([_mark(0), _mark(1)], [_transfer("send", 1, 0), _transfer("recv", 0, 1)])})
    for schedule in schedules.values():
        assert schedule.steps[0]["seconds"] == pytest.approx(_transfer_seconds())


def test_crossed_waits_fall_back_on_the_lowest_rank(tmp_path):
    # each waits for its receive, then sends from a side stream: the card runs it, the model's play would hang
    program = ([_mark(0), _mark(1), _mark(2, stream=1)],)
    schedules = _play_ranks(tmp_path, {
        0: (*program, [_transfer("recv", 1, 0), time_model.Waited(0), _transfer("send", 0, 1)]),
        1: (*program, [_transfer("recv", 0, 1), time_model.Waited(0), _transfer("send", 1, 0)])})
    assert schedules[0].report()["point_to_point"] == {"timed_with_peer": 1, "timed_alone": {p2p_time.CYCLE: 1}}
    assert schedules[1].report()["point_to_point"] == {"timed_with_peer": 2, "timed_alone": {}}


def test_a_wait_for_a_message_and_one_for_a_post_cross_in_the_one_registry(tmp_path):
    # rank 0 waits for rank 1's message, rank 1 for rank 0's post: rank 1, the lowest waiting for a post, goes on
    directory = PlanDirectory(str(tmp_path))
    directory.write_played((0, 1), False)
    name = message_name("pp", 1, 0, 0, 1)
    receiver = threading.Thread(target=directory.wait, args=(
        0, Wait(1, message=name), lambda: directory.delivered(name) or None, os.getppid()), daemon=True)
    receiver.start()
    for _ in range(1000):
        if directory.waits(0) is not None:
            break
        time.sleep(0.01)
    assert directory.waits(0) == Wait(1, message=name)
    posts = p2p_time.PeerPosts(str(tmp_path), 1, {0, 1}, os.getppid())
    unseen = threading.Timer(10, directory.mark_ended, args=(0,))  # a cycle not seen ends the wait otherwise
    unseen.start()
    assert posts.peer_post(p2p_time.Transfer("pp", 0, 1, 1, sends=False)) == (None, p2p_time.CYCLE)
    unseen.cancel()
    assert directory.waits(1) is None
    directory.write_message(name, lambda path: pathlib.Path(path).write_text("sent"))
    receiver.join(timeout=10)
    assert not receiver.is_alive() and directory.waits(0) is None


def test_a_peer_the_plan_does_not_play_keeps_the_collective_timing(tmp_path):
    schedules = _play_ranks(tmp_path, {1: ([_mark(0), _mark(1), _op(SMALL)],
                                           [_transfer("recv", 0, 1), time_model.Waited(0)])}, played=(1,))
    assert schedules[1].steps[0]["seconds"] == pytest.approx(_transfer_seconds() + _seconds(SMALL))
    assert schedules[1].report()["point_to_point"]["timed_alone"] == {p2p_time.PEER_NOT_PLAYED: 1}


# ------------------------------------------------------------------------------------------------
# Planned: the two-stage toy pipeline
# ------------------------------------------------------------------------------------------------
def _plan(tmp_path, name, *options):
    out = tmp_path / f"{name}.json"
    done = fresh_process([sys.executable, "-m", "supa_emu.plan", "--world-size", "2", "--card", "H200",
                          "--json", str(out), *options, "--", str(SCRIPTS / "pipeline_bubble.py")],
                         timeout=600, check=False)
    report = json.loads(out.read_text())
    return {int(rank): entry["time"] for rank, entry in report["ranks"].items()}, done.stdout


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bubble")
    return {mode: _plan(directory, mode, "--rank", "all-stages", "--mode", mode) for mode in ("compute", "shapes")}


@pytest.mark.slow
@pytest.mark.emulation_only
def test_the_later_stage_idles_for_the_earlier_ones_forward(toy):
    timed, _ = toy["compute"]
    forward = next(op["seconds"] for op in timed[0]["top_ops"] if op["op"] == "aten::mm") * 24 / 26 / 3
    for step in timed[1]["steps"][1:]:
        assert step["split"]["idle"] >= 0.95 * forward
    assert timed[1]["step_seconds"] >= forward
    # locked together: each stage's step is the pipeline's
    assert timed[1]["step_seconds"] == pytest.approx(timed[0]["step_seconds"], rel=0.05)
    assert all(t["point_to_point"] == {"timed_with_peer": 6, "timed_alone": {}} for t in timed.values())


@pytest.mark.slow
@pytest.mark.emulation_only
def test_both_modes_plan_the_same_bubble(toy):
    assert toy["compute"][0] == toy["shapes"][0]


@pytest.mark.slow
@pytest.mark.emulation_only
def test_a_stage_played_alone_keeps_its_own_time_and_says_so(toy, tmp_path):
    # --rank 0 plays stage 0 alone: its receive of the gradient does not wait for stage 1's chain
    alone, stdout = _plan(tmp_path, "alone", "--rank", "0", "--mode", "shapes")
    together, later = toy["shapes"][0][0], toy["shapes"][0][1]
    backward = next(op["seconds"] for op in later["top_ops"] if op["op"] == "aten::mm") / 3  # stage 1's chain
    assert alone[0]["point_to_point"] == {"timed_with_peer": 0, "timed_alone": {p2p_time.PEER_NOT_PLAYED: 6}}
    assert together["steps"][-1]["split"]["idle"] >= 0.95 * backward
    assert alone[0]["steps"][-1]["split"]["idle"] < 0.05 * backward
    assert alone[0]["step_seconds"] <= together["step_seconds"] - 0.95 * backward
    assert "the pipeline's waits (its bubble) are not modelled" in stdout


@pytest.mark.slow
@pytest.mark.emulation_only
def test_crossed_waits_in_a_planned_job_fall_back_and_are_counted(tmp_path):
    out = tmp_path / "crossed.json"
    done = fresh_process([sys.executable, "-m", "supa_emu.plan", "--world-size", "2", "--rank", "all-stages",
                          "--mode", "shapes", "--card", "H200", "--json", str(out), "--",
                          str(SCRIPTS / "pipeline_bubble.py"), "--crossed"], timeout=600, check=False)
    ranks = json.loads(out.read_text())["ranks"]
    transfers = [ranks[rank]["time"]["point_to_point"] for rank in ("0", "1")]
    assert transfers[0]["timed_alone"].get(p2p_time.CYCLE, 0) >= 1
    assert sum(t["timed_with_peer"] for t in transfers) + sum(
        sum(t["timed_alone"].values()) for t in transfers) == 2 * 6
    assert "waits crossed" in done.stdout
