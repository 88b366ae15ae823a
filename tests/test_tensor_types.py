"""Legacy torch.supa tensor types and typed storages."""

import pytest

from harness import ANY, fresh_process
import torch

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

TYPES = {
    "ByteTensor": torch.uint8, "CharTensor": torch.int8, "DoubleTensor": torch.float64,
    "FloatTensor": torch.float32, "IntTensor": torch.int32, "LongTensor": torch.int64,
    "ShortTensor": torch.int16, "HalfTensor": torch.float16, "BoolTensor": torch.bool,
    "BFloat16Tensor": torch.bfloat16,
}
STORAGES = {
    "ByteStorage": torch.uint8, "DoubleStorage": torch.float64, "FloatStorage": torch.float32,
    "HalfStorage": torch.float16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "BoolStorage": torch.bool,
    "BFloat16Storage": torch.bfloat16, "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
}


def test_exactly_ten_tensor_types_and_no_complex_ones():
    for name, dtype in TYPES.items():
        cls = getattr(torch.supa, name)
        assert cls.dtype == dtype
        assert cls.is_supa and not cls.is_sparse
        assert cls.layout == torch.strided
    assert not hasattr(torch.supa, "ComplexFloatTensor")
    assert not hasattr(torch.supa, "ComplexDoubleTensor")


@pytest.mark.parametrize("name", [n for n in TYPES if n != "DoubleTensor"])
def test_isinstance_matches_device_and_dtype(name):
    cls = getattr(torch.supa, name)
    dtype = TYPES[name]
    assert isinstance(torch.zeros(2, dtype=dtype, device="supa"), cls)
    assert not isinstance(torch.zeros(2, dtype=dtype), cls)  # CPU tensor
    other = torch.float32 if dtype != torch.float32 else torch.int32
    assert not isinstance(torch.zeros(2, dtype=other, device="supa"), cls)


def test_constructors_build_supa_tensors():
    t = torch.supa.FloatTensor(2, 3)
    assert t.shape == (2, 3) and t.dtype == torch.float32 and t.device.type == "supa"
    d = torch.supa.LongTensor([1, 2, 3])
    assert d.dtype == torch.int64 and d.device.type == "supa"
    assert d.cpu().tolist() == [1, 2, 3]
    assert isinstance(d, torch.supa.LongTensor)


# Printed once per process: another snippet of its interpreter printing it first would leave none here.
def _two_legacy_constructors() -> None:
    torch.supa.FloatTensor(2)
    torch.supa.IntTensor(3)


_LEGACY_CONSTRUCTORS = fresh_process(_two_legacy_constructors, shared=ANY)


def test_constructor_warning_printed_once():
    out = _LEGACY_CONSTRUCTORS.result()
    expected = ("Warning: The torch.supa.*DtypeTensor constructors are no longer recommended. It's best to "
                "use methods such as torch.tensor(data, dtype=*, device='supa') to create tensors.")
    assert out.stdout.count(expected) == 1


def test_tensor_types_cannot_be_subclassed():
    with pytest.raises(TypeError):
        type("Mine", (torch.supa.FloatTensor,), {})


def test_storage_classes():
    for name, dtype in STORAGES.items():
        cls = getattr(torch.supa, name)
        assert issubclass(cls, torch.storage._LegacyStorage)
        assert cls._dtype == dtype
    s = torch.supa.FloatStorage(4)
    assert s.device.type == "supa" and s.dtype == torch.float32 and s.size() == 4
    assert isinstance(s, torch.supa.FloatStorage)
    assert torch.is_storage(s)


def test_storage_from_buffer_is_unavailable():
    with pytest.raises(RuntimeError, match="from_buffer: Not available for SUPA storage"):
        torch.supa.FloatStorage.from_buffer(b"\0" * 8)
