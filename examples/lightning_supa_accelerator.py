"""A PyTorch Lightning accelerator for SUPA cards, and a small Trainer run on it.

Lightning's CUDAAccelerator refuses any device whose type is not "cuda" ("Device should be GPU, got
supa:0 instead"), so `accelerator="gpu"` stops at setup on SUPA cards, real or emulated. SUPAAccelerator
is the same accelerator written against torch.supa.

    SUPA_EMULATE=1 python examples/lightning_supa_accelerator.py                 # one card
    SUPA_EMULATE=1 python examples/lightning_supa_accelerator.py --devices 2     # DDP over bccl
"""

import argparse
import time
from typing import Any, Union

import torch
import lightning as L
from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch.utils.data import DataLoader, TensorDataset


class SUPAAccelerator(Accelerator):
    """Accelerator for Biren SUPA cards (`torch.supa`), in the order of Lightning's Accelerator interface."""

    def setup_device(self, device: torch.device) -> None:
        if device.type != "supa":
            raise ValueError(f"Device should be a SUPA card, got {device} instead")
        torch.supa.set_device(device)

    def setup(self, trainer: "L.Trainer") -> None:
        torch.supa.empty_cache()

    def teardown(self) -> None:
        torch.supa.empty_cache()

    @staticmethod
    def parse_devices(devices: Union[int, str, list[int]]) -> list[int]:
        """`2` -> the first two cards, `-1` -> all, `"0,3"` or `[0, 3]` -> those cards."""
        count = torch.supa.device_count()
        if isinstance(devices, str):
            devices = [int(d) for d in devices.split(",") if d.strip()] if "," in devices else int(devices)
        if isinstance(devices, int):
            devices = list(range(count)) if devices == -1 else list(range(devices))
        missing = [d for d in devices if not 0 <= d < count]
        if missing:
            raise ValueError(f"SUPA cards {missing} requested, {count} visible")
        return list(devices)

    @staticmethod
    def get_parallel_devices(devices: list[int]) -> list[torch.device]:
        return [torch.device("supa", i) for i in devices]

    @staticmethod
    def auto_device_count() -> int:
        return torch.supa.device_count()

    @staticmethod
    def is_available() -> bool:
        return torch.supa.is_available()

    @staticmethod
    def name() -> str:
        return "supa"

    @classmethod
    def register_accelerators(cls, accelerator_registry) -> None:
        accelerator_registry.register(cls.name(), cls, description=cls.__name__)

    def get_device_stats(self, device: Any) -> dict[str, Any]:
        return torch.supa.memory_stats(device)


SUPAAccelerator.register_accelerators(AcceleratorRegistry)  # Trainer(accelerator="supa") works too


class Regression(L.LightningModule):
    """A two-layer MLP learning a fixed random linear map: the loss falls from the first steps."""

    def __init__(self, dim=32, hidden=128):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def on_train_epoch_end(self):
        if self.trainer.is_global_zero:
            loss = self.trainer.callback_metrics["loss"].item()
            print(f"epoch {self.current_epoch}: loss {loss:.4f}, device {self.device}, "
                  f"card memory allocated {torch.supa.memory_allocated(self.device)} bytes", flush=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def dataset(dim=32, n=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    return TensorDataset(x, x @ torch.randn(dim, dim, generator=g) / dim**0.5)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    args = p.parse_args()

    torch.manual_seed(0)
    accelerator = SUPAAccelerator()
    # Lightning gives a non-CUDA accelerator with one device a CPU SingleDeviceStrategy: name the card.
    # Several devices: DDP; its default backend for "supa" devices is bccl.
    strategy = SingleDeviceStrategy(device="supa:0") if args.devices == 1 else DDPStrategy()
    # Lightning's mixed precision autocasts "cuda" unless told the device type.
    plugins = [MixedPrecision(args.precision, device="supa")] if args.precision == "bf16-mixed" else []
    trainer = L.Trainer(
        accelerator=accelerator, devices=args.devices, strategy=strategy, plugins=plugins,
        max_epochs=args.epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(Regression(), DataLoader(dataset(), batch_size=64, shuffle=True))
    if trainer.is_global_zero:
        print(f"trained on {trainer.num_devices} SUPA card(s), strategy {type(trainer.strategy).__name__}, "
              f"backend {getattr(trainer.strategy, '_process_group_backend', None)}, "
              f"{time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
