"""``torch_supa_ext.deepspeed_classes``: DeepSpeed's host-side classes, unavailable on SUPA.

As in the real package, constructing one of these (or calling ``step``) raises
``NotImplementedError("<Class> not yet implemented on SUPA")``.
"""

from .schemas import STUB_CLASS_NAMES


class _NotOnSupa:
    """Base of the stub classes: every entry point raises the real package's error."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} not yet implemented on SUPA")

    def step(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} not yet implemented on SUPA")


class DeepSpeedCPUAdam(_NotOnSupa):
    pass


class DeepSpeedCPUAdagrad(_NotOnSupa):
    pass


class DeepSpeedCPULion(_NotOnSupa):
    pass


class AIOHandle(_NotOnSupa):
    pass


class GDSHandle(_NotOnSupa):
    pass


__all__ = list(STUB_CLASS_NAMES)
