"""Train a Megatron-core GPT of a published size (Megatron-LM's H100 weak-scaling table), bf16, with
Megatron's distributed optimizer, for the planner's time model.

The table (Megatron-LM README, `images/model_table.png`, Megatron-core r0.8.0 on H100s): GPT models,
vocabulary 131,072, sequence 4,096, global batch 192 (1.7B, 7.1B) or 384 (70B) sequences, data-parallel
size 48 in every row. It gives no micro-batch size: this script uses 1 (`--micro-batch`), so a
data-parallel rank accumulates global batch / (DP x micro-batch) micro-batches a step (4 for the
1.7B and 7.1B rows, 8 for the 70B row). Written for CUDA as Megatron users write it; run it under
`python -m supa_emu.plan --mode shapes` (docs/time_on_the_card.md): a real 7.1B model does not fit
a CPU. `--layers/--hidden/--heads/--seq/--vocab` shrink the model for a small real run.

    SUPA_EMULATE=1 python -m supa_emu.plan --world-size 96 --rank 0 --mode shapes --card H100-SXM-80GB \
        -- examples/megatron_core_gpt_at_scale.py --model 7.1b
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

import supa_emu.plan

# Rows of the table: (heads, hidden size, layers, TP, PP, global batch in sequences).
PUBLISHED = {
    "1.7b": (16, 2048, 24, 1, 1, 192),
    "7.1b": (32, 4096, 30, 2, 1, 192),
    "70b": (64, 8192, 84, 8, 2, 384),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(PUBLISHED), default="7.1b", help="a row of the published table")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (the table gives none)")
    p.add_argument("--global-batch", type=int, help="sequences per step over the job (default: the table's)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=131072)
    for name in ("layers", "hidden", "heads", "tp", "pp"):
        p.add_argument(f"--{name}", type=int, help="override the table's row (small real runs)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's sequence parallelism over the TP ranks (the published runs use it)")
    return p.parse_args()


class SDPAttention(MegatronModule):
    """Core attention through torch's scaled_dot_product_attention (causal, no explicit mask), in
    place of the local spec's unfused DotProductAttention (scores materialized, masked softmax):
    Transformer Engine's fused attention, which the published runs used, is not on SUPA cards."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPAttention: attention_bias and packed sequences are not supported")
        # [s, b, heads, head_dim] -> [b, heads, s, head_dim]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale,
            dropout_p=self.dropout if self.training else 0.0, enable_gqa=k.size(1) != q.size(1),
        )
        s, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, hidden / TP]


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm built from Megatron's norm arguments, in place of the local spec's, which
    refuses sequence parallelism (apex's fused norm, which allows it, is not on SUPA cards). With
    sequence parallelism each TP rank normalizes its own part of the sequence: its weight and bias
    are marked `sequence_parallel`, so finalize_model_grads sums their grads over the TP ranks."""

    def __init__(self, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                 normalization="LayerNorm"):
        if config.normalization != "LayerNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError("SequenceParallelLayerNorm: only LayerNorm without zero-centered gamma")
        super().__init__(hidden_size, eps=eps)
        for parameter in (self.weight, self.bias):
            parameter.sequence_parallel = config.sequence_parallel


def layer_spec():
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = SequenceParallelLayerNorm
    return spec


def block_spec(config, vp_stage):
    """This stage's layers and the final norm (the block's default final norm is the local spec's)."""
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer_spec()] * layers, layer_norm=SequenceParallelLayerNorm)


def as_cuda_type_names(model):
    """Megatron's mixed-precision and distributed optimizers sort parameters by their `type()`
    string ('torch.cuda.BFloat16Tensor', ...) and raise TypeError on any other; a supa parameter's
    is 'torch.supa.BFloat16Tensor'. Each parameter's no-argument `type()` answers the CUDA name of
    its dtype (an attribute on the parameter object; `type(dtype)` conversions are unchanged)."""
    for p in model.parameters():
        original = p.type
        name = original().replace(f"torch.{p.device.type}.", "torch.cuda.")

        def type_name(dtype=None, non_blocking=False, _original=original, _name=name, **kwargs):
            return _name if dtype is None and not kwargs else _original(dtype, non_blocking, **kwargs)

        p.type = type_name


def build(args, shape, vpp=None):
    """The model and Megatron's optimizer; with `vpp` (virtual pipeline stages per rank, interleaved
    1F1B) the model is the list of this rank's `vpp` chunks, as Megatron's schedule takes it. With
    `args.sequence_parallel` (TP > 1) the activations between the TP layers are split along the sequence."""
    heads, hidden, layers, tp, pp = shape
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads,  # FFN 4 x hidden, GELU, LayerNorm
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=args.sequence_parallel,
        virtual_pipeline_model_parallel_size=vpp,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        attention_dropout=0.0, hidden_dropout=0.0,
    )
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
    )
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = None if vpp is None else vp_stage
        model = GPTModel(
            config=config, transformer_layer_spec=block_spec(config, stage), vocab_size=args.vocab,
            max_sequence_length=args.seq, share_embeddings_and_output_weights=False,  # untied, as the sizes count
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage), vp_stage=stage,
        )
        model.cuda()
        model = Float16Module(config, model)
        as_cuda_type_names(model)
        # Chunks after the first reduce their grads in one bucket each, as Megatron-LM's trainer builds them.
        chunks.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=model,
                                              disable_bucketing=vp_stage > 0))
    no_sync = [chunk.no_sync for chunk in chunks]
    config.no_sync_func = no_sync if vpp else no_sync[0]  # reduce the grads once a step, not per micro-batch
    config.finalize_model_grads_func = finalize_model_grads
    # clip_grad=0: Megatron's clipping asserts grad.type() == "torch.cuda.FloatTensor" on its fp32 grads.
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, use_distributed_optimizer=True, clip_grad=0.0),
        chunks,
    )
    return (chunks if vpp else chunks[0]), optimizer


def batches(args):
    g = torch.Generator().manual_seed(parallel_state.get_data_parallel_rank())
    while True:
        seqs = torch.randint(args.vocab, (args.micro_batch, args.seq + 1), generator=g)
        yield {"tokens": seqs[:, :-1], "labels": seqs[:, 1:],
               "position_ids": torch.arange(args.seq).expand(args.micro_batch, args.seq)}


def forward_step(data_iterator, model):
    batch = {k: v.cuda() for k, v in next(data_iterator).items()}
    per_token_loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output):
        loss = output.float().mean()
        # The schedule divides the returned loss by the micro-batch count in place: log a copy.
        return loss, {"lm loss": loss.detach().clone()}

    return per_token_loss, loss_func


def main():
    args = parse_args()
    heads, hidden, layers, tp, pp, global_batch = PUBLISHED[args.model]
    shape = [getattr(args, n) or d for n, d in zip(("heads", "hidden", "layers", "tp", "pp"), (heads, hidden, layers, tp, pp))]
    global_batch = args.global_batch or global_batch
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl")
    tp, pp = shape[3], shape[4]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    dp = parallel_state.get_data_parallel_world_size()
    if global_batch % (dp * args.micro_batch):
        raise SystemExit(f"global batch {global_batch} is not a multiple of DP {dp} x micro-batch {args.micro_batch}")
    micro_batches = global_batch // (dp * args.micro_batch)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    model, optimizer = build(args, shape)
    rank = torch.distributed.get_rank()
    if rank == 0:
        sp = " with SP" if args.sequence_parallel else ""
        print(f"GPT {args.model}: {shape[2]} layers, hidden {shape[1]}, {shape[0]} heads, TP {tp}{sp} PP {pp} "
              f"DP {dp}, {micro_batches} micro-batches of {args.micro_batch} x {args.seq} a step", flush=True)
    # Tokens a step per card, as tokens/s per GPU counts them: this DP rank's sequences over the
    # TP x PP cards that share them.
    supa_emu.plan.tokens(micro_batches * args.micro_batch * args.seq // (tp * pp))
    data = batches(args)
    forward_backward = get_forward_backward_func()
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(
            forward_step_func=forward_step, data_iterator=data, model=model, num_microbatches=micro_batches,
            seq_length=args.seq, micro_batch_size=args.micro_batch, forward_only=False,
        )
        optimizer.step()
        if rank == 0 and losses:
            print(f"step {step}: loss {losses[-1]['lm loss'].item():.4f}, {time.perf_counter() - start:.2f} s", flush=True)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
