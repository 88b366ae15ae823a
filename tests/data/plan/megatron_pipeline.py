"""A small Megatron-core GPT over a pipeline (Megatron's own schedules), two steps per schedule.

    megatron_pipeline.py PP TP HIDDEN SEQ SCHEDULE [SCHEDULE...]
        1f1b; interleaved: 2 virtual stages per rank; 1f1b_variable: 1F1B with variable_seq_lengths
        (the stages send each message's shape, int64, before it)

The model, its optimizer and its data are examples/megatron_core_gpt_at_scale.py's (bf16, Megatron's
DDP and distributed optimizer, SDPA attention), shrunk: 8 layers, 4 heads, vocabulary 128, micro-batches
of one sequence, 8 sequences a step over the data-parallel ranks. Each schedule trains its own model
in a planner section of its name after `initialize_model_parallel` (DP = world / (PP x TP); Megatron's
tp-dp-pp order, so rank 0's pipeline is ranks 0, world/PP, ... and its TP peers are ranks 0 to TP-1).
With TP > 1 the model uses Megatron's sequence parallelism, as the published runs do. The stages send
activations of HIDDEN x SEQ / TP bf16 values: above 64 KiB, messages the planner does not carry
(Megatron's stages exchange nothing else at a fixed sequence length).
"""
import gc
import os
import pathlib
import sys
from types import SimpleNamespace

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "examples"))
import megatron_core_gpt_at_scale as gpt  # noqa: E402  (the example's model, optimizer and data)

from supa_emu.plan import section  # noqa: E402

LAYERS, HEADS, GLOBAL_BATCH = 8, 4, 8
VIRTUAL_STAGES = {"1f1b": None, "interleaved": 2, "1f1b_variable": None}
pp, tp, hidden, seq = (int(value) for value in sys.argv[1:5])
args = SimpleNamespace(vocab=128, seq=seq, micro_batch=1, sequence_parallel=tp > 1)

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
torch.distributed.init_process_group("nccl")


def train(name: str) -> None:
    vpp = VIRTUAL_STAGES[name]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp)
    micro_batches = GLOBAL_BATCH // parallel_state.get_data_parallel_world_size()
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    model, optimizer = gpt.build(args, (HEADS, hidden, LAYERS, tp, pp), vpp)
    chunks = model if vpp else [model]
    chunks[0].config.variable_seq_lengths = name == "1f1b_variable"  # the schedule reads the model's config
    data = [gpt.batches(args) for _ in chunks]
    forward_backward = get_forward_backward_func()
    for step in range(2):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(
            forward_step_func=gpt.forward_step, data_iterator=data if vpp else data[0], model=model,
            num_microbatches=micro_batches, seq_length=seq, micro_batch_size=1, forward_only=False,
        )
        optimizer.step()
        if losses:  # the last stage's
            loss = sum(entry["lm loss"].item() for entry in losses) / len(losses)
            print(f"{name}: rank {torch.distributed.get_rank()} step {step} loss {loss:.4f}", flush=True)
    del model, chunks, optimizer, data
    gc.collect()
    parallel_state.destroy_model_parallel()


for schedule in sys.argv[5:]:
    with section(schedule):
        train(schedule)
torch.distributed.destroy_process_group()
