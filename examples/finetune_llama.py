"""Fine-tune a Llama built from its Hugging Face config (no weights downloaded) with DeepSpeed ZeRO-3
or FSDP2: the kind of job people plan at 7B-70B parameters on hundreds of cards.

Run it on real cards as usual (`deepspeed --num_gpus 8 examples/finetune_llama.py ...`, `torchrun
--nproc-per-node 8 examples/finetune_llama.py --engine fsdp2 ...`), or plan a rank of a large job
on a laptop without running a kernel (docs/shapes_mode.md):

    SUPA_EMULATE=1 python -m supa_emu.plan --world-size 1024 --mode shapes -- \\
        examples/finetune_llama.py --shape llama-2-7b --engine deepspeed --seq 4096
    SUPA_EMULATE=1 python -m supa_emu.plan --world-size 1024 --mode shapes -- \\
        examples/finetune_llama.py --shape llama-2-70b --engine fsdp2 --seq 4096

The model is built where it will live, never whole on the host: under deepspeed.zero.Init() (each
rank creates only its shard), or on the meta device and then materialised shard by shard with
to_empty() (FSDP2). Weights are freshly initialised: load a checkpoint where accuracy matters.
Prints one line per step: `STEP {"step", "loss", "peak_bytes", "end_bytes"}`.
"""

import argparse
import json
import os

import torch
import torch._dynamo  # noqa: F401  before zero.Init: DeepSpeed 0.19.8's patched tensor constructors break
#                       torch 2.13's lazily loaded dynamo polyfills otherwise (on any accelerator)
import torch.distributed as dist
import transformers

# (hidden, layers, attention heads, key/value heads, intermediate, vocabulary) of the published models.
SHAPES = {
    "tiny": (256, 2, 4, 2, 688, 1000),
    "llama-2-7b": (4096, 32, 32, 32, 11008, 32000),
    "llama-2-13b": (5120, 40, 40, 40, 13824, 32000),
    "llama-2-70b": (8192, 80, 64, 8, 28672, 32000),
}


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="tiny")
    parser.add_argument("--engine", choices=("deepspeed", "fsdp2"), default="deepspeed")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--micro", type=int, default=1, help="sequences per rank and step")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--no-checkpointing", action="store_true", help="keep every layer's activations")
    parser.add_argument("--local_rank", type=int, default=0, help="(set by the deepspeed launcher)")
    return parser.parse_args()


def llama_config(args) -> transformers.LlamaConfig:
    hidden, layers, heads, kv_heads, intermediate, vocab = SHAPES[args.shape]
    return transformers.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                    num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                                    max_position_embeddings=max(args.seq, 4096), attn_implementation="sdpa",
                                    use_cache=False)


def build(config, args):
    model = transformers.LlamaForCausalLM(config)
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def deepspeed_engine(config, args):
    """ZeRO-3 with bf16 weights and AdamW; each rank builds only its shard of every parameter."""
    import deepspeed

    ds_config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
                 "bf16": {"enabled": True}, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}},
                 "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}}
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = build(config, args)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    def step(tokens):
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        return loss
    return step


def fsdp2_step(config, args, device):
    """FSDP2 over every decoder layer and the whole model, bf16 compute with float32 gradients' reduction."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = build(config, args)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=device)  # each rank materialises its shards only
    with torch.no_grad():  # what from_config would give: N(0, 0.02) matrices, unit norm weights
        for parameter in model.parameters():
            parameter.fill_(1.0) if parameter.dim() == 1 else parameter.normal_(0.0, config.initializer_range)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step(tokens):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss
    return step


def main():
    args = arguments()
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    accelerator.set_device(local_rank)
    device = torch.device(accelerator.device_name(local_rank))
    dist.init_process_group(accelerator.communication_backend_name())
    config = llama_config(args)
    step = deepspeed_engine(config, args) if args.engine == "deepspeed" else fsdp2_step(config, args, device)
    data = torch.Generator().manual_seed(dist.get_rank())
    for i in range(args.steps):
        accelerator.reset_peak_memory_stats(device)
        tokens = torch.randint(0, config.vocab_size, (args.micro, args.seq), generator=data).to(device)
        loss = step(tokens)
        print("STEP " + json.dumps({"step": i, "loss": loss.item(), "peak_bytes": accelerator.max_memory_allocated(device),
                                    "end_bytes": accelerator.memory_allocated(device)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
