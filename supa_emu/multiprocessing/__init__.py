"""`torch_supa.multiprocessing`: what lets supa tensors and events cross process boundaries.

It lives beside, not inside, the emulated `torch_supa` package because activation installs it,
and importing `torch_supa` has the side effects of a user's `import torch_supa`.
"""
