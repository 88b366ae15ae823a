"""Benchmark: one Adam(W) step over ~20M parameters in 200 tensors, against the memory-bandwidth bound.

Prints ms per step, side by side in one run, for
  - the SUPA FusedAdam fallback (supa_deepspeed.op_builder.supa, AdamW mode) on supa parameters (CPU parameters
    when no supa device is available; the output says which),
  - a per-parameter Python loop of Adam steps (the shape of a naive device fallback),
  - torch.optim.AdamW(foreach=True) and (fused=True) on CPU parameters,
in fp32 and bf16, each also as a fraction of the bandwidth bound: the bytes an Adam step must
move (read p, g, m, v; write p, m, v) divided by this machine's copy bandwidth, measured here.

Usage: SUPA_EMULATE=1 PYTHONPATH=. python bench/optimizers.py [--params 20000000] [--tensors 200] [--steps 10]
"""

import argparse
import time

import torch

from supa_deepspeed.op_builder.supa.fused_adam import multi_tensor_adam
from harness import load

LR, BETA1, BETA2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01



def _supa_device():
    try:
        if hasattr(torch, 'supa') and torch.supa.is_available():
            return torch.device('supa', 0), None
        return torch.device('cpu'), "torch.supa is not available"
    except Exception as err:  # the emulator's core not built, etc.
        return torch.device('cpu'), f"torch.supa failed: {err}"


def _sync(device):
    if device.type != 'cpu':
        torch.accelerator.synchronize(device)


def _time(fn, device, steps):
    fn()  # warm-up: lazy state, probes, allocator
    _sync(device)
    best = float('inf')
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - start) / steps)
    return best * 1e3


def copy_bandwidth(nbytes, repeats=10):
    """Bytes/s of a large host memcpy (read + write counted), best of `repeats`."""
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float('inf')
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def _tensors(sizes, dtype, device):
    return [torch.randn(n, dtype=dtype, device=device) for n in sizes]


def _python_loop_adam(params, grads, exp_avgs, exp_avg_sqs, step):
    # One parameter at a time, a handful of tensor ops each: what a device fallback without
    # multi-tensor kernels ends up doing (AdamW mode, fp32 math for 16-bit storage).
    bc1 = 1 - BETA1**step
    bc2 = 1 - BETA2**step
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        p32, g32, m32, v32 = p.float(), g.float(), m.float(), v.float()
        m32.mul_(BETA1).add_(g32, alpha=1 - BETA1)
        v32.mul_(BETA2).addcmul_(g32, g32, value=1 - BETA2)
        update = (m32 / bc1) / ((v32 / bc2).sqrt_().add_(EPS))
        update.add_(p32, alpha=WD)
        p32.add_(update, alpha=-LR)
        if p32 is not p:
            p.copy_(p32)
            m.copy_(m32)
            v.copy_(v32)


def run(total, count, steps):
    sizes = [total // count] * count
    bandwidth = copy_bandwidth(256 << 20)
    device, why_not = _supa_device()
    where = f"{device}" if why_not is None else f"cpu ({why_not}; fallback measured on CPU parameters)"
    print(f"Adam(W) step, {sum(sizes) / 1e6:.1f}M parameters in {count} tensors, best of 3 x {steps} steps")
    print(f"measured copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read+write); fallback device: {where}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; at start: {load()}")
    print(f"{'dtype':<6}{'variant':<42}{'ms/step':>9}{'bound ms':>10}{'bound/actual':>14}")
    for dtype in (torch.float32, torch.bfloat16):
        nbytes = 7 * sum(sizes) * torch.tensor([], dtype=dtype).element_size()
        bound_ms = nbytes / bandwidth * 1e3
        results = []

        p, g, m, v = (_tensors(sizes, dtype, device) for _ in range(4))
        v = [t.abs_() for t in v]
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        counter = [0]

        def fallback():
            counter[0] += 1
            multi_tensor_adam(2048 * 32, flag, [g, p, m, v], LR, BETA1, BETA2, EPS, counter[0], 1, 1, WD)

        results.append((f"SUPA FusedAdam fallback ({device.type})", _time(fallback, device, steps)))

        def loop():
            counter[0] += 1
            _python_loop_adam(p, g, m, v, counter[0])

        results.append((f"per-parameter Python loop ({device.type})", _time(loop, device, steps)))
        del p, g, m, v

        for flavour in ('foreach', 'fused'):
            params = [torch.nn.Parameter(t) for t in _tensors(sizes, dtype, 'cpu')]
            for q in params:
                q.grad = torch.randn_like(q)
            opt = torch.optim.AdamW(params, lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD,
                                    **{flavour: True})
            results.append((f"torch.optim.AdamW({flavour}=True) (cpu)", _time(opt.step, torch.device('cpu'), steps)))
            del opt, params

        name = {torch.float32: 'fp32', torch.bfloat16: 'bf16'}[dtype]
        for label, ms in results:
            print(f"{name:<6}{label:<42}{ms:>9.2f}{bound_ms:>10.2f}{bound_ms / ms:>14.2f}")
        fused_ms = results[-1][1]
        print(f"{name:<6}fallback / fused=True: {results[0][1] / fused_ms:.2f}x")
    print(f"at end: {load()}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--params', type=int, default=20_000_000)
    parser.add_argument('--tensors', type=int, default=200)
    parser.add_argument('--steps', type=int, default=10)
    args = parser.parse_args()
    run(args.params, args.tensors, args.steps)


if __name__ == '__main__':
    main()
