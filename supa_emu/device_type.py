"""The device type name of the emulated cards: PyTorch's PrivateUse1 backend is renamed to it.

A leaf module (no imports), so every part of the emulator names the device from here.
"""

DEVICE_TYPE = "supa"
