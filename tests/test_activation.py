"""When the emulator activates (SUPA_EMULATE at `import torch`), when it stands down (a real
torch_supa is installed), and what `import torch_supa` / `import torch_supa_ext` give. Each case
runs in a fresh interpreter, because activation happens once, at `import torch`; cases that need
no more than the environment at activation share theirs with the other cases of that environment
(`harness.fresh_process(..., shared=...)`). Where the imports a user types are the point, the case
is that code; where what the activated process does is, it is a function of this file."""

import pytest

from harness import ANY, fresh_process

pytestmark = pytest.mark.emulation_only


def test_unset_imports_nothing_of_the_emulator():
    out = fresh_process("""
        import sys, torch
        print(sorted(m for m in sys.modules if m.startswith('supa_emu')))
        print(hasattr(torch, 'supa'), torch._C._get_privateuse1_backend_name())
    """, env={"SUPA_EMULATE": None}).stdout.splitlines()
    assert out == ["['supa_emu']", "False privateuseone"]


_ZERO = fresh_process("import torch; print(hasattr(torch, 'supa'))",
                      env={"SUPA_EMULATE": "0"}, shared=ANY, name="test_activation: SUPA_EMULATE=0")


def test_zero_is_off():
    out = _ZERO.result().stdout
    assert out.strip() == "False"


_ACTIVATES = fresh_process("""
    import torch
    t = torch.ones(2, device='supa')
    print(t.device, torch.supa.is_available(), torch.accelerator.current_accelerator())
""", env={"SUPA_EMULATE": "1"}, shared=ANY, name="test_activation: import torch activates the device")


def test_import_torch_activates_the_device():
    out = _ACTIVATES.result().stdout
    assert out.strip() == "supa:0 True supa"


@pytest.mark.parametrize("emulate", ["1", None])
def test_explicit_activate_before_importing_torch(emulate):
    """activate() before `import torch`: under SUPA_EMULATE=1, torch's autoload re-enters activate()
    from inside it, and both calls agree without waiting on each other."""
    out = fresh_process("""
        import supa_emu
        print(supa_emu.activate())
        import torch
        print(torch.ones(2, device='supa').device)
    """, env={"SUPA_EMULATE": emulate}, timeout=120).stdout.splitlines()
    assert out == ["True", "supa:0"]


def test_native_module_imported_before_torch():
    """`supa_emu.native` imported before torch does not import torch half-way through itself, where
    torch's autoload would find it incomplete."""
    out = fresh_process("""
        from supa_emu import native
        import torch
        print(len(native.build_key()), torch.ones(1, device='supa').device)
    """, env={"SUPA_EMULATE": "1"}, timeout=120).stdout
    assert out.strip() == "16 supa:0"


_TORCH_SUPA = fresh_process("""
    import torch, torch_supa
    print(torch_supa.__version__)
    print(torch_supa.supa is torch.supa)
""", env={"SUPA_EMULATE": "1"}, shared=ANY, name="test_activation: import torch_supa")


def test_import_torch_supa_yields_the_emulator():
    out = _TORCH_SUPA.result().stdout.splitlines()
    assert out[0].startswith("1.0.0.") and "emulated" in out[0]
    assert out[1] == "True"


@pytest.mark.slow  # several fresh interpreters doing real work
def test_torch_supa_ext_only_when_asked():
    code = """
        import torch
        try:
            import torch_supa_ext
            print('present')
        except ImportError:
            print('absent')
    """
    assert fresh_process(code, env={"SUPA_EMULATE": "1", "SUPA_EMU_EXT": None}).stdout.strip() == "absent"
    assert fresh_process(code, env={"SUPA_EMULATE": "1", "SUPA_EMU_EXT": "1"}).stdout.strip() == "present"


def test_stands_down_when_a_real_torch_supa_is_installed(tmp_path):
    package = tmp_path / "torch_supa"
    package.mkdir()
    (package / "__init__.py").write_text("REAL = True\n")
    result = fresh_process("""
        import torch, torch_supa
        print(torch_supa.REAL, hasattr(torch, 'supa'), torch._C._get_privateuse1_backend_name())
    """, env={"SUPA_EMULATE": "1", "PYTHONPATH": str(tmp_path)})
    assert result.stdout.strip() == "True False privateuseone"
    assert result.stderr.count("stands down") == 1


# Every variable is read by config.load() at activation (test_config.py holds each one's message
# to this form); here, the way a bad value reaches the user: SUPA_EMULATE, which the start-up line
# reads first, and one of the variables only activation reads.
@pytest.mark.parametrize("variable, value", [
    ("SUPA_EMULATE", "maybe"),
    ("SUPA_EMU_DEVICE_COUNT", "two"),
])
def test_bad_values_fail_at_activation_naming_the_variable(variable, value):
    env = {"SUPA_EMULATE": "1", variable: value}
    result = fresh_process("import torch", env=env, check=False)
    assert result.returncode != 0
    assert f"{variable}={value!r}" in result.stderr
    assert "accepted" in result.stderr
    # torch's autoload re-raises every failure as a generic RuntimeError; the project's message
    # is the first line the user reads, not only a link in the chained traceback.
    first = result.stderr.splitlines()[0]
    assert first.startswith(f"supa_emu: configuration error: {variable}={value!r}") and "accepted" in first


def _no_cards() -> None:
    import torch

    assert not torch.supa.is_available()
    assert torch.supa.device_count() == 0
    with pytest.raises(RuntimeError):
        torch.ones(1, device='supa')


_NO_VISIBLE_CARDS = {value: fresh_process(_no_cards, env={"SUPA_EMULATE": "1", "SUPA_VISIBLE_DEVICES": value},
                                          shared=ANY)
                     for value in ["-1", ""]}


@pytest.mark.parametrize("value", list(_NO_VISIBLE_CARDS))
def test_no_visible_cards_as_with_cuda_visible_devices(value):
    _NO_VISIBLE_CARDS[value].result()


_MEMORY_BEYOND_THE_HOST = fresh_process("import torch", env={"SUPA_EMULATE": "1", "SUPA_EMU_MEMORY": "99999TiB"},
                                        shared=ANY, name="test_activation: SUPA_EMU_MEMORY beyond the host")


def test_memory_beyond_the_host_warns_at_activation():
    result = _MEMORY_BEYOND_THE_HOST.result()  # the interpreter's stderr: activation warns once, at its start
    assert "RuntimeWarning: SUPA_EMU_MEMORY='99999TiB'" in result.stderr and "host" in result.stderr


def _uses_its_card(rank: int) -> None:
    import torch

    assert torch.supa.is_available()
    assert torch.ones(1, device=f'supa:{rank}').device.index == rank


def _spawns_two_children() -> None:
    import torch.multiprocessing as mp

    mp.spawn(_uses_its_card, nprocs=2)


@pytest.mark.slow  # several fresh interpreters doing real work
def test_multiprocessing_children_are_emulated_too():
    fresh_process(_spawns_two_children, env={"SUPA_EMULATE": "1"})


def _card_uuids() -> list:
    import torch

    return [str(torch.supa.get_device_properties(i).uuid) for i in range(torch.supa.device_count())]


@pytest.mark.slow  # several fresh interpreters doing real work
def test_visible_devices_filter_and_reorder():
    physical = fresh_process(_card_uuids, env={"SUPA_EMULATE": "1", "SUPA_EMU_DEVICE_COUNT": "4"}).value
    visible = fresh_process(_card_uuids, env={"SUPA_EMULATE": "1", "SUPA_EMU_DEVICE_COUNT": "4",
                                              "SUPA_VISIBLE_DEVICES": "3,1"}).value
    assert len(set(physical)) == 4
    # Visible device 0 is physical card 3, visible device 1 is physical card 1: in that order.
    assert visible == [physical[3], physical[1]]


def _where_backward_runs() -> list:
    import threading

    import torch

    x = torch.ones(2, device="supa", requires_grad=True)
    threads = []
    x.register_hook(lambda grad: threads.append(threading.get_ident()))
    (x * 2).sum().backward()
    return ["calling-thread" if threads == [threading.get_ident()] else "device-thread",
            torch.autograd.is_multithreading_enabled()]


_BACKWARD_THREADS = {setting: fresh_process(_where_backward_runs,
                                            env={"SUPA_EMULATE": "1", "SUPA_EMU_AUTOGRAD_DEVICE_THREADS": setting},
                                            shared=ANY)
                     for setting in [None, "0", "1"]}


@pytest.mark.parametrize("setting, expected", [(None, ["calling-thread", False]), ("0", ["calling-thread", False]),
                                              ("1", ["device-thread", True])])
def test_backward_runs_on_the_calling_thread_unless_device_threads_are_asked_for(setting, expected):
    assert _BACKWARD_THREADS[setting].result().value == expected
