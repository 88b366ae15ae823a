"""Uses a card but never initialises a process group: a planned world has no rank to play."""
import torch

x = torch.ones(2, device="supa")
