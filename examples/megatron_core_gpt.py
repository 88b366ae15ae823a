"""Train a tiny Megatron-core GPT with tensor parallelism, then save and load a distributed checkpoint.

Written for CUDA as Megatron-core's users write it ("nccl", torch.cuda); on SUPA cards transfer_to_supa
maps those names. Synthetic data: each token is a fixed function of the one before it (from a random
start), so the loss has something to learn.

    SUPA_EMULATE=1 torchrun --nproc-per-node 2 examples/megatron_core_gpt.py --tp 2
"""

import argparse
import os
import time

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB, SEQ, MICRO_BATCH = 128, 32, 4


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--checkpoint-dir", default="megatron_ckpt", help="created if missing; every rank writes its shards there")
    p.add_argument("--no-checkpoint", action="store_true", help="train only (for the planner: see docs/frameworks.md)")
    return p.parse_args()


def build_model(tp):
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,  # same initial weights on every TP size, built on the host
        pipeline_dtype=torch.float32,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),  # Megatron's own layers, no Transformer Engine
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )
    model.cuda()
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def batches(seed):
    # Every TP rank of a group must see the same batch: one generator seed per data-parallel rank.
    g = torch.Generator().manual_seed(seed + parallel_state.get_data_parallel_rank())
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
    while True:
        seqs = torch.empty(MICRO_BATCH, SEQ + 1, dtype=torch.long)
        seqs[:, 0] = torch.randint(VOCAB, (MICRO_BATCH,), generator=g)
        for i in range(SEQ):
            seqs[:, i + 1] = (5 * seqs[:, i] + 3) % VOCAB
        yield {
            "tokens": seqs[:, :-1],
            "labels": seqs[:, 1:],
            "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, SEQ),
            "attention_mask": causal,
        }


def forward_step(data_iterator, model):
    batch = {k: v.cuda() for k, v in next(data_iterator).items()}
    per_token_loss = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss}

    return per_token_loss, loss_func


def sharded_state(model, optimizer, is_loading):
    state = {"model": model.module.sharded_state_dict(prefix="")}  # the GPTModel inside the DDP wrapper
    state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=is_loading)
    return state


def checkpoint_round_trip(model, optimizer, directory):
    """Save model and optimizer with dist_checkpointing (each rank its shards), zero the weights,
    load them back; True when every weight is back."""
    before = {k: v.detach().clone() for k, v in model.module.state_dict().items() if torch.is_tensor(v)}
    dist_checkpointing.save(sharded_state(model, optimizer, is_loading=False), directory)
    for p in model.parameters():
        p.data.zero_()
    loaded = dist_checkpointing.load(sharded_state(model, optimizer, is_loading=True), directory)
    model.module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    after = model.module.state_dict()
    return all(torch.equal(v, after[k]) for k, v in before.items())


def main():
    args = parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    # The host generator builds the weights (use_cpu_initialization) and is seeded differently in
    # every process: seed it, or the weights TP ranks replicate (position embeddings, norms) differ.
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)  # the card's generators: dropout, same on TP ranks where it must be
    rank = torch.distributed.get_rank()

    model = build_model(args.tp)
    # Megatron's optimizer: it steps on the grads DDP keeps in its buffers (param.main_grad), which a
    # torch.optim optimizer would not see (param.grad stays None). clip_grad=0: Megatron's clipping
    # asserts grad.type() == "torch.cuda.FloatTensor", and a supa tensor's is "torch.supa.FloatTensor".
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0), [model])
    data = batches(seed=0)
    forward_backward = get_forward_backward_func()

    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(
            forward_step_func=forward_step, data_iterator=data, model=model, num_microbatches=1,
            seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False,
        )
        finalize_model_grads([model])  # all-reduce of the grads TP ranks share (layer norms) and over DP
        optimizer.step()
        if rank == 0:
            loss = losses[0]["lm loss"].item()
            print(f"step {step}: loss {loss:.4f}, {time.perf_counter() - start:.2f} s", flush=True)

    if not args.no_checkpoint:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        same = checkpoint_round_trip(model, optimizer, args.checkpoint_dir)
        print(f"rank {rank}: checkpoint saved and loaded, weights equal: {same}", flush=True)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
