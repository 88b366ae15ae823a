"""The switching contract (design §2): when the emulator activates, when it stands down,
and what `import torch_supa` / `import torch_supa_ext` give. Each case runs in a fresh
interpreter, because activation happens once, at `import torch`."""

import pytest

from conftest import run_python

pytestmark = pytest.mark.emulation_only


def test_unset_imports_nothing_of_the_emulator():
    out = run_python("""
        import sys, torch
        print(sorted(m for m in sys.modules if m.startswith('supa_emu')))
        print(hasattr(torch, 'supa'), torch._C._get_privateuse1_backend_name())
    """, env={"SUPA_EMULATE": None}).stdout.splitlines()
    assert out == ["['supa_emu']", "False privateuseone"]


def test_zero_is_off():
    out = run_python("import torch; print(hasattr(torch, 'supa'))", env={"SUPA_EMULATE": "0"}).stdout
    assert out.strip() == "False"


def test_import_torch_activates_the_device():
    out = run_python("""
        import torch
        t = torch.ones(2, device='supa')
        print(t.device, torch.supa.is_available(), torch.accelerator.current_accelerator())
    """, env={"SUPA_EMULATE": "1"}).stdout
    assert out.strip() == "supa:0 True supa"


def test_import_torch_supa_yields_the_emulator():
    out = run_python("""
        import torch, torch_supa
        print(torch_supa.__version__)
        print(torch_supa.supa is torch.supa)
    """, env={"SUPA_EMULATE": "1"}).stdout.splitlines()
    assert out[0].startswith("1.0.0.") and "emulated" in out[0]
    assert out[1] == "True"


def test_torch_supa_ext_only_when_asked():
    code = """
        import torch
        try:
            import torch_supa_ext
            print('present')
        except ImportError:
            print('absent')
    """
    assert run_python(code, env={"SUPA_EMULATE": "1", "SUPA_EMU_EXT": None}).stdout.strip() == "absent"
    assert run_python(code, env={"SUPA_EMULATE": "1", "SUPA_EMU_EXT": "1"}).stdout.strip() == "present"


def test_stands_down_when_a_real_torch_supa_is_installed(tmp_path):
    package = tmp_path / "torch_supa"
    package.mkdir()
    (package / "__init__.py").write_text("REAL = True\n")
    result = run_python("""
        import torch, torch_supa
        print(torch_supa.REAL, hasattr(torch, 'supa'), torch._C._get_privateuse1_backend_name())
    """, env={"SUPA_EMULATE": "1", "PYTHONPATH": str(tmp_path)})
    assert result.stdout.strip() == "True False privateuseone"
    assert result.stderr.count("stands down") == 1


@pytest.mark.parametrize("variable, value", [
    ("SUPA_EMULATE", "maybe"),
    ("SUPA_EMU_DEVICE_COUNT", "two"),
    ("SUPA_EMU_MEMORY", "lots"),
    ("SUPA_VISIBLE_DEVICES", "0,0"),
    ("SUPA_EMU_EXT", "2"),
])
def test_bad_values_fail_at_activation_naming_the_variable(variable, value):
    env = {"SUPA_EMULATE": "1", variable: value}
    result = run_python("import torch", env=env, check=False)
    assert result.returncode != 0
    assert f"{variable}={value!r}" in result.stderr
    assert "accepted" in result.stderr


def test_multiprocessing_children_are_emulated_too():
    out = run_python("""
        import torch, torch.multiprocessing as mp

        def child(rank):
            assert torch.supa.is_available()
            assert torch.ones(1, device=f'supa:{rank}').device.index == rank

        if __name__ == '__main__':
            mp.spawn(child, nprocs=2)
            print('ok')
    """, env={"SUPA_EMULATE": "1"}).stdout
    assert out.strip() == "ok"


def test_visible_devices_filter_and_reorder():
    out = run_python("""
        import torch
        print(torch.supa.device_count())
        print(torch.supa.get_device_properties(0).uuid == torch.supa.get_device_properties(1).uuid)
    """, env={"SUPA_EMULATE": "1", "SUPA_EMU_DEVICE_COUNT": "4", "SUPA_VISIBLE_DEVICES": "3,1"}).stdout.split()
    assert out == ["2", "False"]
