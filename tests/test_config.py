"""Parsing and validation of the SUPA_* variables (supa_emu.config)."""

import pytest

from supa_emu import config
from supa_emu.device_profile import PROFILES


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("SUPA_EMULATE", "SUPA_EMU_DEVICE_COUNT", "SUPA_VISIBLE_DEVICES", "SUPA_EMU_MEMORY",
                 "SUPA_EMU_PROFILE", "SUPA_EMU_EXT", "BRTB_ENABLE_DTYPE_DEMOTION", "SUPA_DS_ACCELERATOR",
                 "SUPA_EMU_SANITIZE", "SUPA_EMU_AUTOGRAD_DEVICE_THREADS", "SUPA_EMU_SUBLAS_WORKSPACE_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def test_defaults():
    cfg = config.load()
    assert cfg.device_count == 8
    assert cfg.visible_devices == tuple(range(8))
    assert cfg.memory_bytes == PROFILES["BR104"].total_memory
    assert cfg.profile.total_memory == cfg.memory_bytes
    assert not cfg.ext and not cfg.dtype_demotion
    assert cfg.deepspeed_accelerator == "project"
    assert cfg.sanitize == "off"
    assert not cfg.autograd_device_threads  # backward on the calling thread


@pytest.mark.parametrize("raw, expected", [
    ("1073741824", 1 << 30), ("16GiB", 16 << 30), ("512M", 512 << 20), ("1.5G", 3 << 29), ("2GB", 2 * 10**9),
])
def test_memory_sizes(monkeypatch, raw, expected):
    monkeypatch.setenv("SUPA_EMU_MEMORY", raw)
    assert config.load().memory_bytes == expected


@pytest.mark.parametrize("raw", ["", "lots", "12 parsecs", "-1G", "100"])
def test_bad_memory_sizes(monkeypatch, raw):
    monkeypatch.setenv("SUPA_EMU_MEMORY", raw)
    with pytest.raises(config.ConfigError, match="SUPA_EMU_MEMORY"):
        config.load()


def test_visible_devices_reorder(monkeypatch):
    monkeypatch.setenv("SUPA_EMU_DEVICE_COUNT", "4")
    monkeypatch.setenv("SUPA_VISIBLE_DEVICES", "3, 1")
    assert config.load().visible_devices == (3, 1)
    monkeypatch.setenv("SUPA_VISIBLE_DEVICES", "")
    assert config.load().visible_devices == ()


@pytest.mark.parametrize("raw, expected", [("-1", ()), ("", ()), (" ", ()), ("2,-1,0", (2,)), ("1,", (1,)),
                                           ("3,0,-5", (3, 0))])
def test_visible_devices_end_at_a_negative_id_or_empty_entry_as_with_cuda(monkeypatch, raw, expected):
    monkeypatch.setenv("SUPA_EMU_DEVICE_COUNT", "4")
    monkeypatch.setenv("SUPA_VISIBLE_DEVICES", raw)
    assert config.load().visible_devices == expected


@pytest.mark.parametrize("raw", ["4", "1,1", "a", "0;1", "1gpu"])
def test_bad_visible_devices(monkeypatch, raw):
    monkeypatch.setenv("SUPA_EMU_DEVICE_COUNT", "4")
    monkeypatch.setenv("SUPA_VISIBLE_DEVICES", raw)
    with pytest.raises(config.ConfigError, match="SUPA_VISIBLE_DEVICES.*accepted"):
        config.load()


@pytest.mark.parametrize("name, raw", [("SUPA_EMULATE", "perhaps"), ("SUPA_EMULATE", "maybe"), ("SUPA_EMU_EXT", "2"),
                                       ("SUPA_EMU_DEVICE_COUNT", "65"), ("SUPA_EMU_DEVICE_COUNT", "two"),
                                       ("SUPA_EMU_MEMORY", "lots"), ("SUPA_VISIBLE_DEVICES", "0,0"),
                                       ("SUPA_EMU_PROFILE", "BR999"), ("SUPA_DS_ACCELERATOR", "cuda"),
                                       ("SUPA_EMU_SANITIZE", "races"), ("SUPA_EMU_AUTOGRAD_DEVICE_THREADS", "device")])
def test_bad_values_name_the_variable(monkeypatch, name, raw):
    # Activation prints this message after "supa_emu: configuration error: " as the user's first line
    # (test_activation.py::test_bad_values_fail_at_activation_naming_the_variable): the variable and
    # its value first, then what is accepted.
    monkeypatch.setenv(name, raw)
    with pytest.raises(config.ConfigError) as error:
        config.load()
    assert str(error.value).startswith(f"{name}={raw!r}") and "accepted" in str(error.value), error.value


def test_memory_beyond_the_host_is_flagged_only_when_asked_for(monkeypatch):
    monkeypatch.setattr(config, "host_memory_bytes", lambda: 8 << 30)
    assert config.memory_beyond_host(config.load()) is None  # the profile's 32 GiB is only a ceiling
    monkeypatch.setenv("SUPA_EMU_MEMORY", "4GiB")
    assert config.memory_beyond_host(config.load()) is None
    monkeypatch.setenv("SUPA_EMU_MEMORY", "99999TiB")
    warning = config.memory_beyond_host(config.load())
    assert "SUPA_EMU_MEMORY='99999TiB'" in warning and "8.0 GiB" in warning


@pytest.mark.parametrize("raw, expected", [("1", True), ("true", True), ("ON", True), ("0", False), ("no", False)])
def test_switches(monkeypatch, raw, expected):
    monkeypatch.setenv("SUPA_EMULATE", raw)
    assert config.emulation_requested() is expected


@pytest.mark.parametrize("raw, expected", [(None, False), ("", False), ("off", False), (" No ", False),
                                           ("1", True), ("Yes", True), ("maybe", True)])
def test_emulation_wanted_lets_only_off_spellings_stand_down(monkeypatch, raw, expected):
    # A value that is no switch counts as wanted, so activation reaches config.load(), which rejects it.
    from supa_emu import switches

    if raw is None:
        monkeypatch.delenv("SUPA_EMULATE", raising=False)
    else:
        monkeypatch.setenv("SUPA_EMULATE", raw)
    assert switches.emulation_wanted() is expected
    if raw == "maybe":
        with pytest.raises(config.ConfigError, match="SUPA_EMULATE='maybe' is not a valid switch"):
            config.load()


@pytest.mark.parametrize("raw, installs_finder", [(None, False), ("0", False), ("off", False), ("1", True)])
def test_startup_line_installs_the_finder_only_when_emulation_is_wanted(raw, installs_finder):
    """setup.py's .pth line, run at start-up without site (and without torch)."""
    import sys

    import harness

    setup_source = (harness.ROOT / "setup.py").read_text()
    pth_line = setup_source.split("PTH_LINE = ", 1)[1].split("\n)\n", 1)[0] + "\n)"
    probe = (eval(pth_line) + "import sys; print(any(type(f).__module__ == 'supa_emu.import_hooks' for f in "
             "sys.meta_path), 'torch' in sys.modules)\n")
    out = harness.fresh_process([sys.executable, "-S", "-c", probe],
                                env={"SUPA_EMULATE": raw, "PYTHONPATH": harness.ROOT}, timeout=60, check=False)
    assert out.stdout.split() == [str(installs_finder), "False"], out.stderr


def test_blas_workspace_defaults_to_the_profile_s(monkeypatch):
    assert config.load().blas_workspace_bytes == PROFILES["BR104"].blas_workspace_size == 32 << 20


@pytest.mark.parametrize("raw, expected", [(":4096:8", 32 << 20), (":4096:2:16:8", (8192 + 128) << 10), (":0:0", 0),
                                           (" :16:8 ", 128 << 10)])
def test_blas_workspace_config_in_cublas_form(monkeypatch, raw, expected):
    monkeypatch.setenv("SUPA_EMU_SUBLAS_WORKSPACE_CONFIG", raw)
    assert config.load().blas_workspace_bytes == expected


@pytest.mark.parametrize("raw", ["", "4096:8", ":4096", ":4096:8:", "32MiB", ":-1:8", ":4096:x"])
def test_bad_blas_workspace_config(monkeypatch, raw):
    monkeypatch.setenv("SUPA_EMU_SUBLAS_WORKSPACE_CONFIG", raw)
    with pytest.raises(config.ConfigError, match=r"SUPA_EMU_SUBLAS_WORKSPACE_CONFIG=.*':SIZE:COUNT'"):
        config.load()
