"""`torch_supa.contrib`: opt-in adapters; `transfer_to_supa` makes CUDA-named code run on SUPA cards."""
