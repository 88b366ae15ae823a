"""Compiled flex attention on supa whose score_mod and mask_mod capture Python ints that Dynamo makes
symbolic (dynamic shapes: a window, an offset, a sequence length), as torchtitan's pipelined models
do. On a card the Triton templates take such an int as a kernel argument; the emulator's fused
training kernels take it as a SymInt argument (supa_emu/compile/flex_attention.py), so one compiled
graph serves every value, and its results equal eager flex attention on the CPU (its dense
definition, uncompiled).
"""

import pytest
import sympy

from test_compile import TOLERANCE, CompileCounter, assert_close_relative, last_device
import torch

pytestmark = pytest.mark.skipif(not (hasattr(torch, "supa") and torch.supa.is_available()),
                                reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

SHAPE = BATCH, HEADS, LENGTH, HEAD_DIM = (2, 2, 256, 16)  # two 128-token blocks of the mask


def leaves(device):
    """q, k, v, a learnt bias per head and key, and document ids (two documents per sequence), the
    same values on every device; all but the ids take gradients."""
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(SHAPE, generator=generator) for _ in range(3)]
    tensors.append(torch.randn(HEADS, LENGTH, generator=generator))
    tensors = [t.to(device).requires_grad_() for t in tensors]
    documents = (torch.arange(LENGTH) >= torch.tensor([[100], [160]])).int()
    return tensors, documents.to(device)


def mods(key_bias, documents, shift: int, window: int, device):
    """A score_mod capturing a tensor and an int, and the block mask of a mask_mod capturing an int
    and a tensor (the ints interleave with the tensors in the graphs' captures)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + key_bias[h, kv_idx] + (q_idx - kv_idx + shift) * 0.01

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx < window) & (q_idx >= kv_idx) & (documents[b, q_idx] == documents[b, kv_idx])

    return score_mod, create_block_mask(mask_mod, BATCH, HEADS, LENGTH, LENGTH, device=device)


@pytest.mark.slow  # compiles a forward and a backward graph
def test_captured_symbolic_ints_are_bound_when_the_compiled_training_step_runs():
    from torch.nn.attention.flex_attention import flex_attention

    device, counter = last_device(), CompileCounter()
    compiled = torch.compile(flex_attention, dynamic=True, backend=counter)
    for shift, window in ((3, 64), (40, 200)):  # a second value of each: the same graph, other results
        cpu, cpu_documents = leaves("cpu")
        score_mod, block_mask = mods(cpu[3], cpu_documents, shift, window, "cpu")
        expected = flex_attention(*cpu[:3], score_mod=score_mod, block_mask=block_mask)
        expected.square().sum().backward()

        card, documents = leaves(device)
        score_mod, block_mask = mods(card[3], documents, shift, window, device)
        out = compiled(*card[:3], score_mod=score_mod, block_mask=block_mask)
        out.square().sum().backward()

        tol, what = TOLERANCE[torch.float32], f"shift {shift}, window {window}"
        assert out.device == device
        assert_close_relative(out, expected, tol, f"output ({what})")
        for name, leaf, cpu_leaf in zip(("q", "k", "v", "key bias"), card, cpu):
            assert leaf.grad.device == device
            assert_close_relative(leaf.grad, cpu_leaf.grad, tol, f"gradient of {name} ({what})")
    assert counter.graphs == 1  # the ints were arguments of the compiled code, not constants in it


def test_a_capture_the_fused_kernels_cannot_take_is_refused_with_what_they_take():
    from supa_emu.compile.flex_attention import _captured

    # A symbolic float (Dynamo specializes floats unless told not to): neither tensor nor integer.
    with pytest.raises(NotImplementedError, match="the mask_mod captures .*take captured tensors and integers"):
        _captured([sympy.Symbol("slope", real=True)], "mask_mod")
    integer = sympy.Symbol("window", integer=True)
    assert _captured([integer, 7], "score_mod") == ([], [integer, 7], [0, 1])


def _compiled_flex_with_a_float_dynamo_does_not_specialize() -> list:
    """In a fresh process: compiled flex attention in training whose score_mod captures a float, with
    specialize_float off and a second value of the float; what each step did."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.specialize_float = False
    compiled, steps = torch.compile(flex_attention), []
    for slope in (0.5, 0.25):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score * slope

        q, k, v = (torch.randn(1, 1, 128, 16, device="supa", requires_grad=True) for _ in range(3))
        try:
            compiled(q, k, v, score_mod=score_mod).sum().backward()
            steps.append("trained")
        except RuntimeError as error:
            steps.append(str(error))
    return steps


@pytest.mark.slow  # compiles in a fresh process
def test_compiled_code_called_with_fake_tensors_raises_instead_of_crashing():
    from harness import fresh_process

    # The second value makes Dynamo trace into PyTorch's flex attention autograd, which builds its
    # graphs under FakeTensorMode; the code it compiles there then meets fake tensors. A kernel
    # run on them would write through a null pointer (the process died with SIGSEGV).
    first, second = fresh_process(_compiled_flex_with_a_float_dynamo_does_not_specialize).value
    assert first == "trained"
    assert "generated kernels with fake tensors" in second and "FakeTensorMode was active" in second, second
