"""torchtitan 0.3.0 configs for torch 2.13 on SUPA cards: pass as `--module torchtitan_supa`.

torchtitan 0.3.0 is built against a PyTorch nightly; two of its defaults need what torch 2.13
does not have. Everything else is torchtitan's own llama3 (or deepseek_v3) config of the same name.

The `*_sdpa` configs also replace flex attention (block-causal, under torch.compile) with
torchtitan's ScaledDotProductAttention (causal over the whole sequence, eager): a model change,
for plans that must not compile (docs/frameworks.md says where).

Every config builds `PlannedTrainer`, torchtitan's Trainer that also tells the planner the tokens
each step trains per card (`supa_emu.plan.tokens`), so a plan reports tokens/s per card the way
torchtitan's own `tps` counts them; in a run that is not planned the marker does nothing. It also
drives pipeline schedules the way torch 2.13 takes them, so `--parallelism.pipeline-parallel-degree`
trains (docs/planner.md, "Pipeline parallelism").
"""

import dataclasses

import torch
import torch.distributed as dist
from torchtitan.components.optimizer import default_adamw
from torchtitan.config import CompileConfig
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.deepseek_v3 import config_registry as _deepseek_v3
from torchtitan.models.llama3 import config_registry as _titan
from torchtitan.models.llama3 import model_registry as _llama3_model
from torchtitan.trainer import Trainer

try:
    from supa_emu import plan as _plan
except ImportError:  # a real card's stack without the emulator: nothing plans, nothing to mark
    _plan = None

if not hasattr(dist, "set_timeout"):
    # The trainer calls torch.distributed.set_timeout after the first step; torch 2.13 has
    # the same operation only as a ProcessGroup method.
    def _set_timeout(timeout, group=None):
        (group or dist.distributed_c10d._get_default_group()).set_timeout(timeout)

    dist.set_timeout = _set_timeout


class PlannedTrainer(Trainer):
    """torchtitan's Trainer, marking the tokens of a step per card for the planner."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def __init__(self, config):
        super().__init__(config)
        if _plan is not None:
            # torchtitan's tps: the tokens of a step's batches on this rank (every microbatch of
            # gradient accumulation) over the cards that share them (TP, PP, CP: its
            # non_data_parallel_size), so tokens/s per card here is what its log calls tps.
            training = config.training
            per_step = training.local_batch_size * training.seq_len * self.gradient_accumulation_steps
            _plan.tokens(per_step // self.parallel_dims.non_data_parallel_size)

    def pp_forward_backward_step(self, *, input_dict_mbs, label_mbs, global_valid_tokens):
        # torchtitan 0.3.0 hands Schedule.step its microbatches already split (arg_mbs=, target_mbs=);
        # torch 2.13's step takes the whole batch (positional inputs, target=) and splits it into the
        # schedule's microbatches itself (flex attention's BlockMask too), and would pass arg_mbs= to
        # the model. So: the microbatches joined again along the batch, prepared as torchtitan
        # prepares a batch (its attention masks built for the whole), then torch 2.13's call.
        first = input_dict_mbs[0]
        joined = {key: torch.cat([mb[key] for mb in input_dict_mbs]) if isinstance(value, torch.Tensor) else value
                  for key, value in first.items()}
        inputs, labels, extra = self.post_dataloading_process(joined, torch.cat(label_mbs))
        losses = [] if self.pp_has_last_stage else None
        with self.train_context():
            self.pp_schedule.step(*((inputs,) if self.pp_has_first_stage else ()),
                                  target=labels if self.pp_has_last_stage else None, losses=losses,
                                  loss_kwargs={"global_valid_tokens": global_valid_tokens}, return_outputs=False,
                                  **extra)
        if self.pp_has_last_stage:
            return torch.sum(torch.stack(losses)).to(self.device)
        return torch.tensor([-1.0], device=self.device)


def _for_torch_2_13(config):
    # The default "spmd_types" backend hands fully_shard plain tensors with dp_mesh_dims, which
    # torch 2.13's FSDP2 refuses ("all parameters must be DTensors on the full SPMD mesh").
    config.parallelism.spmd_backend = "partial_dtensor"
    return PlannedTrainer.Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init})


def _with_sdpa(config):
    # The trainer builds no attention mask for a maskless backend; SDPA then runs with is_causal
    # (DeepSeek-V3's latent attention too: its inner attention is the same kind of module).
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def llama3_debugmodel():
    return _for_torch_2_13(_titan.llama3_debugmodel())


def llama3_8b():
    return _for_torch_2_13(_titan.llama3_8b())


def llama3_70b():
    return _for_torch_2_13(_titan.llama3_70b())


def llama3_405b():
    # torchtitan's llama3_405b as its published 3D table ran it, in bf16: its own builds a float8
    # converter (torchao), so this is its llama3_70b (the same loss, vocabulary, TP 8, full activation
    # checkpointing) with the 405B model and llama3_405b's optimizer, warm-up and local batch, and no
    # compile (--compile.enable compiles, as for the others). PP: --parallelism.pipeline-parallel-degree.
    config = _titan.llama3_70b()
    config.model_spec = _llama3_model("405B")
    config.hf_assets_path = "./assets/hf/Llama-3.1-405B"
    config.optimizer = default_adamw(lr=8e-5)
    config.lr_scheduler.warmup_steps = 600
    config.training.local_batch_size = 2
    config.compile = CompileConfig()
    return _for_torch_2_13(config)


def llama3_405b_sdpa():
    return _with_sdpa(llama3_405b())


def llama3_debugmodel_sdpa():
    return _with_sdpa(llama3_debugmodel())


def llama3_8b_sdpa():
    return _with_sdpa(llama3_8b())


def llama3_70b_sdpa():
    return _with_sdpa(llama3_70b())


def deepseek_v3_debugmodel():
    # torchtitan's DeepSeek-V3 debug model as configured: flex attention (block-causal, compiled as
    # torchtitan always compiles it) and selective activation checkpointing.
    return _for_torch_2_13(_deepseek_v3.deepseek_v3_debugmodel())


def deepseek_v3_debugmodel_sdpa():
    # An MoE model (8 experts, top-3): with --parallelism.expert-parallel-degree, expert parallelism
    # (docs/planner.md, "Expert parallelism").
    return _with_sdpa(deepseek_v3_debugmodel())


def deepseek_v3_671b():
    # torchtitan's DeepSeek-V3 671B (256 routed experts, top-8, 61 layers; flex attention, selective
    # activation checkpointing), not compiling its loss (--compile.enable compiles). No *_sdpa here:
    # latent attention's keys are wider than its values, and SDPA on such heads is the math kernel,
    # which holds the L x L scores (32 GiB per layer at local batch 4, sequence 4096).
    config = _for_torch_2_13(_deepseek_v3.deepseek_v3_671b())
    config.compile = CompileConfig()
    return config
