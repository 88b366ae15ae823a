"""supa-emu's DeepSpeed op builders, laid out like DeepSpeed's op_builder/<accelerator>/ tree.

The builders for the SUPA device live in the `op_builder/supa` subpackage (installed as
`supa_deepspeed.op_builder.supa`, see setup.py).

This package deliberately does not define `__deepspeed__`: DeepSpeed's accelerators probe
`from op_builder import __deepspeed__` to decide whether they run from a DeepSpeed source
checkout, and answering yes here would send DeepSpeed's own CPU/CUDA accelerators looking for
`op_builder.cpu` / `op_builder.cuda` in this package.
"""
