"""A DeepSpeed user's script with no accelerator selection in it: prints, as one JSON line, the
accelerator DeepSpeed chose and what work on its device gives.

    report_choice.py [DEVICE]    (the device to work on; the accelerator's device 0 if none)
"""
import json
import sys

import torch
from deepspeed.accelerator import get_accelerator
import deepspeed.accelerator.real_accelerator as real_accelerator

acc = get_accelerator()
device = sys.argv[1] if len(sys.argv) > 1 else acc.device(0)
x = torch.randn(3, device=device)
y = (torch.arange(6., device=device) * 2 + 1).sum().item()
print(json.dumps({
    "class": type(acc).__module__ + "." + type(acc).__qualname__,
    "same_everywhere": real_accelerator.get_accelerator() is acc,
    "device_name": acc.device_name(), "device": str(device), "x_device": str(x.device), "y": y,
    "allocated": acc.memory_allocated(0) if acc.device_name() == "supa" else None,
}))
