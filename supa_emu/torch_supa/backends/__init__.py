"""`torch_supa.backends`: backend switches of the SUPA stack (copied onto torch.backends.cuda by the transfer)."""
