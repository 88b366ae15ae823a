"""What the emulated `supa` device costs over plain CPU tensors, measured side by side.

Run: SUPA_EMULATE=1 python bench/device_overhead.py [--against CHECKOUT] [--rows WORD ...] [--clock thread]

Each workload runs on CPU tensors in one process and on supa tensors in another, in
alternating rounds, and the median times are compared. The CPU side is a plain PyTorch process
(SUPA_EMULATE unset), so nothing the emulator does in its process (threads, allocations) can
slow the reference: run in one process, the two sides shared OpenMP's state, and autograd's
device thread once made the CPU side up to 3x slower too, which hid the cost. Machines are
noisy: read the ratios, not the absolute times; the load average at start and end is printed
with them. Targets: <= 1.0x on the training steps and the large op, <= 1 us of emulation
overhead per tiny op. --against CHECKOUT adds a third side, supa from another checkout of the
project (its supa_emu first on the path), in the same alternating rounds, and its time and
supa/base (below 1: this checkout is faster); --rows picks the rows whose name contains a word;
--clock thread times each worker's CPU time instead of wall time (with OMP_NUM_THREADS=1), for a
machine busy with other work.
The bf16 rows are far below 1.0x on a host without bf16 matrix instructions,
where the CPU side's bfloat16 kernels are slow and supa's products and convolutions run in float32.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

import pathlib

from harness import ROOT, checkout_argument, checkout_env, commit, load, require_supa, running_checkout


def _seconds_per_call(fn, inner: int, clock=time.perf_counter) -> float:
    start = clock()
    for _ in range(inner):
        fn()
    return (clock() - start) / inner


# --clock thread: the CPU time of the worker's thread, which a machine busy with other work does not
# stretch as it stretches wall time (with OMP_NUM_THREADS=1 the thread does all of a worker's work).
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


_REPLY = "seconds:"  # marks the worker's answers on its stdout, whatever else a library prints there


def serve(device: str, clock: str) -> None:
    """A side's worker: builds each workload on `device` when first asked (and runs it once to warm
    allocators and caches), then answers each "<workload> <calls>" line with seconds per call."""
    workloads = {workload.__name__: workload for _, workload, _, _ in ROWS}
    ready = {}
    print(f"{_REPLY}{torch.__version__} {torch.get_num_threads()} {running_checkout()}", flush=True)
    for line in sys.stdin:
        name, inner = line.split()
        if name not in ready:
            ready[name] = workloads[name](device)
            ready[name]()
        print(f"{_REPLY}{_seconds_per_call(ready[name], int(inner), CLOCKS[clock])}", flush=True)


class Side:
    """One side of the comparison: a worker process that runs the workloads on one device type."""

    def __init__(self, device: str, clock: str, checkout: pathlib.Path | None = None):
        env = dict(os.environ)
        if device == "cpu":
            env.pop("SUPA_EMULATE", None)  # the reference is plain PyTorch, without the emulator
        if checkout is not None:
            env = checkout_env(env, checkout)
        self.device = device
        self.process = subprocess.Popen([sys.executable, __file__, "--serve", device, "--clock", clock], env=env,
                                        text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.version, threads, ran = self._reply().split(maxsplit=2)
        self.threads = int(threads)
        expected = str(checkout or ROOT) if device == "supa" else ran
        if ran != expected:
            raise SystemExit(f"the {device} worker ran the checkout {ran}, not {expected}")

    def _reply(self) -> str:
        for line in self.process.stdout:
            if line.startswith(_REPLY):
                return line[len(_REPLY):].strip()
        raise SystemExit(f"the {self.device} worker exited with code {self.process.wait()} (its error is above)")

    def seconds_per_call(self, workload, inner: int) -> float:
        self.process.stdin.write(f"{workload.__name__} {inner}\n")
        self.process.stdin.flush()
        return float(self._reply())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()
        self.process.stdout.close()


def compare(sides, workload, rounds: int, inner: int) -> list[float]:
    """Median seconds per call on each side, measured in alternating rounds.

    The sides swap places every round (cpu then supa, supa then cpu, ...): whichever runs second
    finds the caches the first one left, which moved a row by up to 0.1 when cpu always ran first.
    """
    samples = {side: [] for side in sides}
    for round_ in range(rounds):
        for side in sides if round_ % 2 == 0 else reversed(sides):
            samples[side].append(side.seconds_per_call(workload, inner))
    return [statistics.median(samples[side]) for side in sides]


def _adamw_step(parameters, loss, **adamw_options):
    """One training step: AdamW on the gradient of `loss()`."""
    opt = torch.optim.AdamW(parameters, lr=1e-3, **adamw_options)

    def step():
        opt.zero_grad(set_to_none=True)
        loss().backward()
        opt.step()
    return step


def _mlp_step(device: str, dtype: torch.dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    model = model.to(device, dtype)
    x, y = (torch.randn(64, 256, device=device, dtype=dtype) for _ in range(2))
    return _adamw_step(model.parameters(), lambda: torch.nn.functional.mse_loss(model(x), y))


def mlp_step(device: str):
    return _mlp_step(device, torch.float32)


def transformer_step(device: str):
    torch.manual_seed(0)
    block = torch.nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True,
                                             dropout=0.0).to(device)
    x = torch.randn(8, 64, 256, device=device)
    return _adamw_step(block.parameters(), lambda: block(x).pow(2).mean())


def cnn_step(device: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 10)).to(device)
    x, y = torch.randn(32, 3, 32, 32, device=device), torch.randint(0, 10, (32,), device=device)
    return _adamw_step(model.parameters(), lambda: torch.nn.functional.cross_entropy(model(x), y))


def _lstm_step(device: str, **adamw_options):
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(64, 128, batch_first=True).to(device)
    head = torch.nn.Linear(128, 64).to(device)
    x, y = torch.randn(16, 32, 64, device=device), torch.randn(16, 32, 64, device=device)
    return _adamw_step([*lstm.parameters(), *head.parameters()],
                       lambda: torch.nn.functional.mse_loss(head(lstm(x)[0]), y), **adamw_options)


def lstm_step(device: str):
    return _lstm_step(device)


def lstm_step_single_tensor_adamw(device: str):
    # PyTorch's optimizers take their foreach path for tensors on the devices in its foreach list
    # (cuda, xpu, mtia and the PrivateUse1 device, here supa) and their single-tensor loop for CPU
    # tensors. With six small parameters the foreach path costs more on CPU kernels, so this row
    # runs the loop on both sides: the difference between the two LSTM rows is PyTorch's choice
    # of path, not the emulator.
    return _lstm_step(device, foreach=False)


def bf16_mlp_step(device: str):
    # Half-precision products run through the host's float32 GEMM on supa (docs/device_model.md#operators);
    # on CPU tensors, PyTorch's bfloat16 kernels, which are slow on hosts without bf16 matrix instructions.
    return _mlp_step(device, torch.bfloat16)


def bf16_matrix_product(device: str):
    a, b = (torch.randn(512, 512, device=device, dtype=torch.bfloat16) for _ in range(2))

    def run():
        torch.mm(a, b)
    return run


def bf16_convolution(device: str):
    x = torch.randn(8, 32, 32, 32, device=device, dtype=torch.bfloat16)
    w = torch.randn(32, 32, 3, 3, device=device, dtype=torch.bfloat16)

    def run():
        torch.nn.functional.conv2d(x, w, padding=1)
    return run


def tiny_inplace_ops(device: str):
    t = torch.zeros(16, device=device)

    def run():
        for _ in range(100):
            t.add_(1.0)
    return run


def small_allocating_ops(device: str):
    x, y = (torch.randn(256, device=device) for _ in range(2))

    def run():
        for _ in range(100):
            x + y
    return run


def large_elementwise(device: str):
    a = torch.randn(16 * 1024 * 1024, device=device)
    b = torch.randn(16 * 1024 * 1024, device=device)

    def run():
        torch.add(a, b, alpha=0.5)
    return run


ROWS = [
    ("MLP train step (256-1024-256, batch 64)", mlp_step, 20, "ms"),
    ("transformer block train step (d=256, seq 64)", transformer_step, 5, "ms"),
    ("small CNN train step (2 conv, 32x32, batch 32)", cnn_step, 5, "ms"),
    ("LSTM train step (64->128, seq 32, batch 16)", lstm_step, 5, "ms"),
    ("  the same, AdamW(foreach=False) on both sides", lstm_step_single_tensor_adamw, 5, "ms"),
    ("bf16 MLP train step (256-1024-256, batch 64)", bf16_mlp_step, 5, "ms"),
    ("bf16 matrix product (512x512x512)", bf16_matrix_product, 5, "ms"),
    ("bf16 3x3 convolution (8x32x32x32, 32 filters)", bf16_convolution, 5, "ms"),
    ("100 tiny in-place ops (add_ on 16 floats)", tiny_inplace_ops, 20, "us/op"),
    ("100 small ops with a result (x + y, 256 floats)", small_allocating_ops, 20, "us/op"),
    ("large elementwise add (16M floats)", large_elementwise, 5, "ms"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--against", type=pathlib.Path, metavar="CHECKOUT",
                        help="another checkout of this project, timed as a third side (base)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="thread: each worker's CPU time (run with OMP_NUM_THREADS=1) on a busy machine")
    parser.add_argument("--rows", nargs="+", metavar="WORD", help="only the rows whose name contains a word")
    parser.add_argument("--serve", choices=["cpu", "supa"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.clock)
        return
    require_supa()
    against = checkout_argument(parser, args.against)
    sides = [Side("cpu", args.clock), Side("supa", args.clock)]
    if against:
        sides.append(Side("supa", args.clock, against))
    print(f"torch {sides[1].version}, {sides[1].threads} threads (cpu side: {sides[0].threads}), one process per "
          f"side, median of {args.rounds} alternating rounds, {args.clock} clock; at start: {load()}")
    if against:
        print(f"supa: {ROOT} ({commit(ROOT)}); base: {against} ({commit(against)})")
    print(f"{'workload':<48}{'cpu':>12}{'supa':>12}{'supa/cpu':>10}" + (f"{'base':>12}{'supa/base':>11}" if against else ""))
    for name, workload, inner, unit in ROWS:
        if args.rows and not any(word in name for word in args.rows):
            continue
        cpu, supa, *base = compare(sides, workload, args.rounds, inner)
        scale = 1e6 / 100 if unit == "us/op" else 1e3
        line = f"{name:<48}{cpu * scale:>9.2f} {unit:<3}{supa * scale:>8.2f} {unit:<3}{supa / cpu:>8.2f}x"
        if base:
            line += f"{base[0] * scale:>8.2f} {unit:<3}{supa / base[0]:>9.2f}x"
        print(line)
        if unit == "us/op":
            print(f"{'  emulation overhead per op':<48}{(supa - cpu) * scale:>21.2f} us"
                  + (f"{(base[0] - cpu) * scale:>19.2f} us" if base else ""))
    for side in sides:
        side.close()
    print(f"at end: {load()}")


if __name__ == "__main__":
    main()
