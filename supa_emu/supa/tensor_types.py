"""Legacy per-dtype tensor types (`torch.supa.FloatTensor`, ...) and storages of the supa device.

These predate `torch.tensor(..., device=...)`. Calling a tensor type builds a supa tensor of
its dtype with the legacy constructor rules; `isinstance(t, torch.supa.FloatTensor)` is True
for float32 supa tensors. There are no complex tensor types, only complex storages.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._utils import classproperty
from torch.storage import _LegacyStorage, _warn_typed_storage_removal

from supa_emu.device_type import DEVICE_TYPE

from ._runtime import _lazy_init, current_device, device_count
from ._runtime import device as _device_ctx

_TENSOR_TYPES = {
    "ByteTensor": torch.uint8, "CharTensor": torch.int8, "DoubleTensor": torch.float64,
    "FloatTensor": torch.float32, "IntTensor": torch.int32, "LongTensor": torch.int64,
    "ShortTensor": torch.int16, "HalfTensor": torch.float16, "BoolTensor": torch.bool,
    "BFloat16Tensor": torch.bfloat16,
}
_STORAGE_TYPES = {
    "ByteStorage": torch.uint8, "DoubleStorage": torch.float64, "FloatStorage": torch.float32,
    "HalfStorage": torch.float16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "BoolStorage": torch.bool,
    "BFloat16Storage": torch.bfloat16, "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
}

__all__ = [*_TENSOR_TYPES, *_STORAGE_TYPES]

_LEGACY_WARNING = (
    "Warning: The torch.supa.*DtypeTensor constructors are no longer recommended. It's best to "
    "use methods such as torch.tensor(data, dtype=*, device='supa') to create tensors.")
_warned_legacy_constructor = False


class _SupaTensorType(type):
    """Metaclass of the legacy tensor types: instance checks by device and dtype, and calling
    the type constructs a supa tensor."""

    def __new__(mcs, name: str, bases: tuple[type, ...], namespace: dict[str, Any]):
        if any(isinstance(base, _SupaTensorType) for base in bases):
            raise TypeError(f"type 'torch.supa.{bases[0].__name__}' is not an acceptable base type")
        return super().__new__(mcs, name, bases, namespace)

    @property
    def dtype(cls) -> torch.dtype:
        return cls._dtype

    @property
    def layout(cls) -> torch.layout:
        return torch.strided

    @property
    def is_supa(cls) -> bool:
        return True

    @property
    def is_sparse(cls) -> bool:
        return False

    def __instancecheck__(cls, obj: Any) -> bool:
        return (isinstance(obj, torch.Tensor) and obj.device.type == DEVICE_TYPE
                and obj.layout == torch.strided and obj.dtype == cls._dtype)

    def __call__(cls, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Legacy constructor: sizes give an uninitialised tensor, a sequence gives its data.

        Prints a one-time recommendation to use torch.tensor; raises TypeError when no SUPA
        device is available.
        """
        global _warned_legacy_constructor
        if not _warned_legacy_constructor:
            _warned_legacy_constructor = True
            print(_LEGACY_WARNING)
        if device_count() == 0:
            raise TypeError(f"type 'torch.supa.{cls.__name__}' not available. Torch not compiled with supa enabled.")
        _lazy_init()
        # Tensor.new applies the legacy constructor rules for the template's dtype and device.
        template = torch.empty(0, dtype=cls._dtype, device=torch.device(DEVICE_TYPE, current_device()))
        return template.new(*args, **kwargs)

    def __repr__(cls) -> str:
        return f"<class 'torch.supa.{cls.__name__}'>"


def _make_tensor_type(name: str, dtype: torch.dtype) -> type:
    return _SupaTensorType(name, (), {"_dtype": dtype, "__module__": "torch.supa", "__qualname__": name,
                                      "__doc__": f"Legacy supa tensor type of dtype {dtype}."})


for _name, _dtype in _TENSOR_TYPES.items():
    globals()[_name] = _make_tensor_type(_name, _dtype)
    torch._tensor_classes.add(globals()[_name])


class _SupaBase:
    """Mixin of legacy supa objects: they report `is_supa`, convert under their own device, and
    initialise the runtime when created."""

    is_supa = True
    is_sparse = False

    def type(self, *args: Any, **kwargs: Any) -> Any:
        with _device_ctx(self.get_device()):
            return super().type(*args, **kwargs)  # type: ignore[misc]

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        _lazy_init()
        return super().__new__(cls, *args, **kwargs)


class _SupaLegacyStorage(_LegacyStorage):
    """Base of the legacy typed storages on supa; the `torch.supa` module name gives them the
    supa device."""

    @classmethod
    def from_buffer(cls, *args: Any, **kwargs: Any) -> Any:
        _warn_typed_storage_removal()
        raise RuntimeError("from_buffer: Not available for SUPA storage")

    @classmethod
    def _new_with_weak_ptr(cls, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("_new_with_weak_ptr: Not available for SUPA storage")

    @classmethod
    def _new_shared_filename(cls, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("_new_shared_filename: Not available for SUPA storage")


def _make_storage_type(name: str, dtype: torch.dtype) -> type:
    def dtype_(cls: type) -> torch.dtype:
        _warn_typed_storage_removal()
        return cls._dtype

    def raw_dtype(cls: type) -> torch.dtype:
        return dtype

    return type(name, (_SupaLegacyStorage,), {
        # TypedStorage derives the device from the last component of the module name.
        "__module__": "torch.supa",
        "__qualname__": name,
        "__doc__": f"Legacy supa storage of dtype {dtype}.",
        "dtype": classproperty(dtype_),
        "_dtype": classproperty(raw_dtype),
    })


for _name, _dtype in _STORAGE_TYPES.items():
    globals()[_name] = _make_storage_type(_name, _dtype)
    torch._storage_classes.add(globals()[_name])

del _name, _dtype
