"""Fine-tunes a tiny Llama with the Hugging Face Trainer: no device-specific code, nothing downloaded.

The Trainer (through accelerate) finds the accelerator through torch.cuda, which on a SUPA
machine is the SUPA card (transfer_to_supa). Run on emulated cards:

    SUPA_EMULATE=1 python examples/train_hf_trainer.py
    SUPA_EMULATE=1 python examples/train_hf_trainer.py --bf16
    SUPA_EMULATE=1 SUPA_VISIBLE_DEVICES=0,1 python examples/train_hf_trainer.py   # DataParallel, 2 cards
    SUPA_EMULATE=1 torchrun --nproc-per-node 2 examples/train_hf_trainer.py --deepspeed-stage 2
    SUPA_EMULATE=1 deepspeed --num_gpus 2 examples/train_hf_trainer.py --deepspeed-stage 2

The model is built from a config and the data is synthetic: every sample is the same number of
tokens, and the whole data set is one global batch, so every optimizer step sees all of it in any
order and any split across ranks. That makes the losses of a 1-process and a 2-process run equal.
Prints one JSON line (rank 0): the logged losses, where the parameters lived while training, the
distributed backend.
"""

import argparse
import json
import os
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8, help="size of the data set = the global batch")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU (the reference run)")
    parser.add_argument("--deepspeed-stage", type=int, choices=(0, 1, 2, 3), default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args()


class TokenWalks(torch.utils.data.Dataset):
    """Token sequences that follow a fixed successor table: something a language model can learn."""

    def __init__(self, samples: int, seq_len: int, vocab: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        successor = torch.randperm(vocab, generator=generator)
        tokens = torch.empty(samples, seq_len, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (samples,), generator=generator)
        for position in range(1, seq_len):
            tokens[:, position] = successor[tokens[:, position - 1]]
        self.tokens = tokens

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


class ParameterDevices(TrainerCallback):
    """Records the devices the parameters are on when each optimizer step begins."""

    def __init__(self):
        self.devices = set()

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.devices.update(str(p.device) for p in model.parameters())


def deepspeed_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": "auto"},
    }


def main():
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    data = TokenWalks(args.samples, args.seq_len, config.vocab_size, args.seed)
    devices = ParameterDevices()
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=args.samples // world,
            max_steps=args.steps,
            learning_rate=1e-2,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            bf16=args.bf16,
            use_cpu=args.cpu,
            seed=args.seed,
            dataloader_drop_last=True,
            deepspeed=deepspeed_config(args.deepspeed_stage) if args.deepspeed_stage is not None else None,
            disable_tqdm=True,
        )
        # One process driving several visible cards splits each batch over them (DataParallel).
        training.per_device_train_batch_size = args.samples // world // max(training.n_gpu, 1)
        trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[devices])
        trainer.train()
    if trainer.is_world_process_zero():
        backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
        result = {
            "event": "result",
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "parameter_devices": sorted(devices.devices),
            "backend": backend,
            "world_size": world,
            "n_gpu": training.n_gpu,
        }
        if args.deepspeed_stage is not None:
            from deepspeed.accelerator import get_accelerator

            result["deepspeed_accelerator"] = f"{type(get_accelerator()).__module__}.{type(get_accelerator()).__name__}"
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
