"""DeepSpeed's PipelineModule: an MLP of stages of different widths over all ranks, two train_batch steps."""
import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule

deepspeed.init_distributed()
world = torch.distributed.get_world_size()
widths = [32 + 16 * (s % 3) for s in range(2 * world)] + [32]
layers = []
for index in range(2 * world):
    layers += [LayerSpec(torch.nn.Linear, widths[index], widths[index + 1]), LayerSpec(torch.nn.ReLU)]
torch.manual_seed(0)
model = PipelineModule(layers=layers, num_stages=world, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)


def batches():
    while True:
        yield torch.randn(4, widths[0]), torch.randn(4, widths[-1])


data = batches()
for step in range(2):
    loss = engine.train_batch(data_iter=data)
    if engine.is_last_stage():
        print(f"step {step} loss {loss.item():.4f}", flush=True)
