"""Several scripts run one after the other in one process, each as it would run in a fresh one.

    python tests/script_sequence.py '[[name, script, *args], ...]'

A multi-process job then pays the fixed cost of its processes (torchrun's, and each rank's imports
of torch, DeepSpeed, transformers: seconds each) once for all its scripts rather than once per
script (test_deepspeed_training's and test_plan's jobs). Between two scripts the process is put
back as a fresh one would find it: no process group (and new group names, see `run`), no cached
card memory, peak statistics at zero, torch.compile's caches and counters empty.

What a process cannot be put back to is the card memory earlier scripts left allocated: DeepSpeed's
engines hold their parameters in reference cycles through autograd's C++ nodes, which Python's
collector cannot see (so on a real card too), and some of it goes later, when the next script
replaces what held it. Memory figures of a script after the first are not a fresh process's:
run a script whose memory figures are read in a job of its own.

Rank 0 prints `SCRIPT-START <name>` before a script and `SCRIPT-END <name>` after it returned, each
on a line of its own, and `outputs` splits a finished job's stdout by them. Only rank 0 does: the
ranks share the job's pipes, and a line another rank wrote could land inside one of rank 0's (a
print() with PYTHONUNBUFFERED writes its text and its newline apart).
"""

import gc
import json
import os
import sys

import harness

START, END = "SCRIPT-START ", "SCRIPT-END "


def run(scripts, around=None) -> None:
    """Runs each [name, script, *args] of `scripts` as `python script *args` would, in turn;
    `around(name)`, where given, is a context manager each script runs in."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    rank_zero = os.environ.get("RANK", "0") == "0"
    with harness.cpu_asked_once():  # DeepSpeed asks again for each CPU optimizer
        for index, (name, script, *args) in enumerate(scripts):
            # destroy_process_group restarts group names at 0, and a rendezvous under a used name would
            # read the previous script's peers from the job's store: each script's groups get new names.
            distributed_c10d._world.group_count = 1000 * index
            if rank_zero:
                harness.print_line(START + name)
            with around(name) if around is not None else contextlib.nullcontext():
                harness.run_as_main([script, *args])
            if rank_zero:
                harness.print_line(END + name)
            if dist.is_initialized():
                dist.destroy_process_group()
            gc.collect()
            gc.freeze()  # what is left now stays: later collections need not look through it again
            if "torch._dynamo" in sys.modules:  # compiled code and its counters belong to the script
                torch._dynamo.reset()
                torch._dynamo.utils.counters.clear()
            torch.supa.empty_cache()
            for device in range(torch.supa.device_count()):
                torch.supa.reset_peak_memory_stats(device)


def batched(selected, run_together):
    """get(name) -> what `run_together` gave for `name`, run at most once: the first request of a
    name in `selected` (a list, in running order) runs it with every name of `selected` not run yet,
    in one call of run_together(names) -> {name: result}; a name outside `selected` runs alone.
    (A fixture runs the scripts of the selected tests in one job, a single test's in a short one.)"""
    results = {}

    def get(name):
        if name not in results:
            results.update(run_together([n for n in selected if n not in results] if name in selected else [name]))
        return results[name]
    return get


def outputs(finished: harness.Finished, names) -> dict:
    """name -> Finished of each script of a finished sequence job: its stdout is what rank 0 printed
    from that script's start to its end; stderr is the whole job's (all ranks, all scripts). A
    script rank 0 got past has returncode 0, the one it was in when the job ended the job's, one it
    never reached None. (A rank other than 0 that fails a script rank 0 has already got past fails
    the next one: rank 0 waits for it there.)"""
    lines, ended, current = {}, set(), None
    for line in finished.stdout.splitlines(keepends=True):
        if line.startswith(START):
            current = line[len(START):].strip()
            lines[current] = []
        elif line.startswith(END):
            ended.add(line[len(END):].strip())
            current = None
        elif current is not None:
            lines[current].append(line)
    results = {}
    for name in names:
        code = 0 if name in ended else None if name not in lines else (finished.returncode or 1)
        results[name] = harness.Finished(finished.command, code, "".join(lines.get(name, [])), finished.stderr)
    return results


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
