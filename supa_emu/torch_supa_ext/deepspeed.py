"""``torch_supa_ext.deepspeed``: registers the deepspeed:: ops that have SUPA kernels.

In the real package this is the compiled extension; importing it defines the 23 ops and their
SUPA kernels. Here each op gets a reference kernel (plain PyTorch on the device) for the
PrivateUse1 key, which torch_supa renames to ``supa``, plus a fake (meta) implementation so
the ops trace under torch.compile and FakeTensorMode.
"""

from . import normalization, optimizers, pointwise, quantization
from .registry import OpTable
from .schemas import DEEPSPEED_NAMESPACE, KERNEL_SCHEMAS

DEVICE_DISPATCH_KEY = "PrivateUse1"

KERNELS = {**normalization.KERNELS, **optimizers.KERNELS, **pointwise.KERNELS, **quantization.KERNELS}
FAKES = {**normalization.FAKES, **optimizers.FAKES, **pointwise.FAKES, **quantization.FAKES}


def _register():
    table = OpTable(DEEPSPEED_NAMESPACE, KERNEL_SCHEMAS)
    if set(KERNELS) != set(table.names) or set(FAKES) != set(table.names):
        raise ImportError("torch_supa_ext: the reference kernels do not match the ops with SUPA kernels: "
                          f"missing {sorted(set(table.names) - set(KERNELS))}, "
                          f"extra {sorted(set(KERNELS) - set(table.names))}")
    for name in table.names:
        table.impl(name, KERNELS[name], DEVICE_DISPATCH_KEY)
        table.fake(name, FAKES[name])
    return table


OPS = _register().names
