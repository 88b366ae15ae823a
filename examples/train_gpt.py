"""Trains a tiny GPT-style language model with DeepSpeed on SUPA cards (real or emulated).

Run on two emulated cards:

    SUPA_EMULATE=1 deepspeed --num_gpus 2 examples/train_gpt.py --config examples/configs/zero2.json
    SUPA_EMULATE=1 torchrun --nproc-per-node 2 examples/train_gpt.py --config examples/configs/zero2.json

The script is the same on a machine with real SUPA cards (drop SUPA_EMULATE). It only uses public
APIs: deepspeed.init_distributed() (which picks the `bccl` backend), get_accelerator(), torch.supa.

The data is generated, not downloaded: every sequence is a walk on a fixed random "successor" table
(token t is followed by succ[t] most of the time, by a random token otherwise), so there is
something to learn and the loss falls quickly from ln(vocab) towards the walk's entropy. Every
batch is a pure function of (seed, step), which makes runs reproducible and resuming trivial.
"""

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

# DeepSpeed 0.19 still calls torch.distributed functions that torch now deprecates
# (all_gather_into_tensor, ...); every rank would print the FutureWarning between the losses.
# Silenced here, in this script only, and only for those deprecation notices.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning,
                        module=r"torch\.distributed\.")


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class GPTConfig:
    vocab: int = 128
    seq_len: int = 32
    dim: int = 64
    layers: int = 2
    heads: int = 4


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln_attn = nn.LayerNorm(cfg.dim)
        # No bias: a key bias cannot change attention (softmax ignores a constant added to a row of
        # scores), so its gradient is pure rounding noise that Adam would turn into full-size steps.
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln_mlp = nn.LayerNorm(cfg.dim)
        self.fc_in = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.fc_out = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).split(dim, dim=-1)
        # (batch, seq, dim) -> (batch, heads, seq, head_dim)
        q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_mlp(x))))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig, checkpoint_fn=None):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_out = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        # With activation checkpointing, a block's activations are recomputed in backward
        # instead of being kept from forward: less memory, more compute.
        self.checkpoint_fn = checkpoint_fn

    def forward(self, tokens, targets):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = self.checkpoint_fn(block, x) if self.checkpoint_fn and self.training else block(x)
        logits = self.head(self.ln_out(x))
        # Loss in fp32 even when the model runs in fp16/bf16.
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------

def successor_table(vocab: int, seed: int) -> torch.Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))


def global_batch(step: int, seed: int, num_sequences: int, cfg: GPTConfig, follow_prob: float = 0.8):
    """The whole step's data, (num_sequences, seq_len + 1) int64 tokens on the CPU.

    Deterministic in (seed, step). Every data-parallel rank builds the same global batch and takes
    its own slice, so the split across ranks never changes what the model learns.
    """
    succ = successor_table(cfg.vocab, seed)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.empty(num_sequences, cfg.seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(cfg.vocab, (num_sequences,), generator=gen)
    follow = torch.rand(num_sequences, cfg.seq_len, generator=gen) < follow_prob
    noise = torch.randint(cfg.vocab, (num_sequences, cfg.seq_len), generator=gen)
    for i in range(cfg.seq_len):
        tokens[:, i + 1] = torch.where(follow[:, i], succ[tokens[:, i]], noise[:, i])
    return tokens


def micro_batches(step, seed, cfg, micro_batch, accumulation, world_size, rank):
    """This rank's micro-batches of one optimizer step, as (inputs, targets) pairs.

    The global batch is laid out as [accumulation step][rank][sequence]."""
    tokens = global_batch(step, seed, accumulation * world_size * micro_batch, cfg)
    tokens = tokens.view(accumulation, world_size, micro_batch, cfg.seq_len + 1)[:, rank]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------

def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="DeepSpeed JSON config (see examples/configs/)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to train for (in total)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab", type=int, default=GPTConfig.vocab)
    parser.add_argument("--seq-len", type=int, default=GPTConfig.seq_len)
    parser.add_argument("--dim", type=int, default=GPTConfig.dim)
    parser.add_argument("--layers", type=int, default=GPTConfig.layers)
    parser.add_argument("--heads", type=int, default=GPTConfig.heads)
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block's activations in backward (deepspeed.checkpointing)")
    parser.add_argument("--checkpoint-dir", help="where to save DeepSpeed checkpoints")
    parser.add_argument("--save-interval", type=int, default=0,
                        help="save every N steps (and after the last step); 0 saves only after the last step")
    parser.add_argument("--resume", action="store_true",
                        help="load the latest checkpoint in --checkpoint-dir and continue up to --steps")
    parser.add_argument("--compile", action="store_true",
                        help="compile the model with the accelerator's torch.compile backend (engine.compile())")
    parser.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="json: one JSON object per line, for scripts and tests")
    # The deepspeed launcher passes --local_rank; torchrun sets LOCAL_RANK instead.
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    return parser.parse_args()


def log(args, event, **fields):
    """Prints one event: a JSON object per line, or a line of text for people."""
    if args.log_format == "json":
        print(json.dumps({"event": event, **fields}), flush=True)
        return
    if event == "start":
        print(f"training {fields['parameters']:,} parameters on {fields['world_size']} ranks "
              f"({fields['accelerator']}, backend {fields['backend']}): ZeRO stage {fields['zero_stage']}, "
              f"{fields['optimizer']}, micro-batch {fields['micro_batch']} x {fields['accumulation']} "
              f"accumulation step(s)")
    elif event == "resumed":
        print(f"resumed from {fields['path']} after step {fields['step']}")
    elif event == "step":
        scale = f"  loss scale {fields['loss_scale']:g}" if fields["loss_scale"] is not None else ""
        skipped = "  (update skipped: gradient overflow)" if not fields["applied"] else ""
        memory = " | ".join(f"{b / 2**20:.2f}" for b in fields["memory_allocated_bytes"])
        print(f"step {fields['step']:4d}  loss {fields['loss']:.4f}  {fields['step_time'] * 1000:7.1f} ms  "
              f"{fields['tokens_per_second']:9,.0f} tokens/s  memory per card {memory} MiB{scale}{skipped}")
    elif event == "compile":
        print(f"torch.compile: {fields['graphs']} graph(s), {fields['graph_breaks']} graph break(s)")
    elif event == "summary":
        print(f"{fields['steps']} steps in {fields['time']:.1f} s ({fields['time'] / max(fields['steps'], 1):.3f} s/step, "
              f"{fields['tokens_per_second']:,.0f} tokens/s), final loss {fields['final_loss']:.4f}")
        print(f"{'rank':>4}  {'card':<7}  {'peak in training':>16}  {'peak in initialize':>18}")
        for rank, device in enumerate(fields["devices"]):
            print(f"{rank:>4}  supa:{device:<2}  {fields['peak_bytes'][rank] / 2**20:12.2f} MiB  "
                  f"{fields['initialize_peak_bytes'][rank] / 2**20:14.2f} MiB")
    sys.stdout.flush()


def main():
    args = parse_args()
    accelerator = get_accelerator()
    accelerator.set_device(args.local_rank)
    deepspeed.init_distributed()  # backend from the accelerator: bccl on SUPA
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(accelerator.device_name(args.local_rank))

    checkpoint_fn = None
    if args.activation_checkpointing:
        deepspeed.checkpointing.configure(None, deepspeed_config=args.config)
        checkpoint_fn = deepspeed.checkpointing.checkpoint

    # Every rank builds the same initial weights from the seed; DeepSpeed then places (and, under
    # ZeRO-3, partitions) them on the cards.
    cfg = GPTConfig(args.vocab, args.seq_len, args.dim, args.layers, args.heads)
    torch.manual_seed(args.seed)
    model = TinyGPT(cfg, checkpoint_fn)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=args.config)
    if args.compile:
        engine.compile()
    # Placing the whole model on the card before partitioning it is a one-off cost of initialize();
    # measure training on its own from here.
    initialize_peak = torch.supa.max_memory_allocated(device)
    torch.supa.reset_peak_memory_stats(device)

    first_step = 1
    if args.resume:
        path, client_state = engine.load_checkpoint(args.checkpoint_dir)
        if path is None:
            raise SystemExit(f"--resume: no checkpoint found in {args.checkpoint_dir}")
        first_step = client_state["step"] + 1
        if rank == 0:
            log(args, "resumed", path=path, step=client_state["step"])

    if rank == 0:
        params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
        log(args, "start", accelerator=accelerator.device_name(), backend=torch.distributed.get_backend(),
            world_size=world_size, parameters=params, zero_stage=engine.zero_optimization_stage(),
            optimizer=type(engine.basic_optimizer).__name__, micro_batch=engine.train_micro_batch_size_per_gpu(),
            accumulation=engine.gradient_accumulation_steps())

    accumulation = engine.gradient_accumulation_steps()
    tokens_per_step = accumulation * world_size * engine.train_micro_batch_size_per_gpu() * cfg.seq_len
    training_time, final_loss = 0.0, float("nan")
    for step in range(first_step, args.steps + 1):
        batches = micro_batches(step, args.seed, cfg, engine.train_micro_batch_size_per_gpu(), accumulation,
                                world_size, rank)
        accelerator.synchronize()
        started = time.perf_counter()
        step_loss = torch.zeros((), device=device)
        for inputs, targets in batches:
            loss = engine(inputs.to(device), targets.to(device))
            engine.backward(loss)
            engine.step()  # applies the update only at the accumulation boundary
            step_loss += loss.detach().float() / accumulation
        # Every rank saw different data: the mean over ranks is the loss of the whole step.
        dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)
        accelerator.synchronize()
        step_time = time.perf_counter() - started
        training_time += step_time
        # What each card holds after the step (one small gather; not part of the timed step).
        allocated = torch.tensor([torch.supa.memory_allocated(device)], dtype=torch.int64, device=device)
        per_card = [torch.zeros_like(allocated) for _ in range(world_size)]
        dist.all_gather(per_card, allocated)
        final_loss = step_loss.item()
        if rank == 0:
            log(args, "step", step=step, loss=final_loss, applied=engine.was_step_applied(),
                loss_scale=getattr(engine.optimizer, "cur_scale", None) if engine.fp16_enabled() else None,
                step_time=step_time, tokens_per_second=tokens_per_step / step_time,
                memory_allocated_bytes=[int(t.item()) for t in per_card])
        if args.checkpoint_dir and (step == args.steps or (args.save_interval and step % args.save_interval == 0)):
            engine.save_checkpoint(args.checkpoint_dir, tag=f"step{step}", client_state={"step": step})

    if args.compile and rank == 0:
        from torch._dynamo.utils import counters

        log(args, "compile", graphs=counters["stats"]["unique_graphs"],
            graph_breaks=sum(counters["graph_break"].values()))
    peak = torch.supa.max_memory_allocated(device)
    peaks = [None] * world_size
    dist.all_gather_object(peaks, (device.index, initialize_peak, peak))
    if rank == 0:
        steps_run = max(args.steps - first_step + 1, 0)
        log(args, "summary", steps=steps_run, time=training_time, final_loss=final_loss,
            tokens_per_second=tokens_per_step * steps_run / training_time if training_time else 0.0,
            devices=[p[0] for p in peaks], initialize_peak_bytes=[p[1] for p in peaks],
            peak_bytes=[p[2] for p in peaks])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
