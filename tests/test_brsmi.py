"""`brsmi`, the management CLI: answered for the emulated cards with SUPA_EMULATE=1, and
otherwise handed over to Biren's real tool later on PATH (never shadowing it)."""

import os
import pathlib
import sys

import pytest

import harness

emulation_only = pytest.mark.emulation_only


def brsmi(*args, **env):
    return harness.fresh_process(["brsmi", *args], env=env, timeout=60, check=False)


def _our_brsmi() -> str:
    """This project's console script (next to the interpreter, where pip puts it)."""
    script = pathlib.Path(sys.executable).parent / "brsmi"
    if not script.exists():
        pytest.skip("supa-emu's brsmi console script is not installed next to this interpreter")
    return str(script)


def _without_emulation(path: str, *args):
    return harness.fresh_process([_our_brsmi(), *args], env={"SUPA_EMULATE": None, "PATH": path}, timeout=60,
                                 check=False)


def _fake_real_brsmi(directory: pathlib.Path) -> pathlib.Path:
    directory.mkdir(parents=True)
    tool = directory / "brsmi"
    tool.write_text('#!/bin/sh\necho "real brsmi: $*"\n')
    tool.chmod(0o755)
    return directory


def test_without_emulation_the_real_brsmi_later_on_path_answers(tmp_path):
    real = _fake_real_brsmi(tmp_path / "biren" / "bin")
    path = os.pathsep.join([str(pathlib.Path(_our_brsmi()).parent), str(real), os.environ["PATH"]])
    result = _without_emulation(path, "gpu", "list")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "real brsmi: gpu list"


def test_without_emulation_and_no_real_tool_it_says_how_to_get_the_emulated_one(tmp_path):
    # A launcher shim that just runs this project's script again (as pyenv's does) must not loop.
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "brsmi").write_text(f'#!/bin/sh\nexec "{_our_brsmi()}" "$@"\n')
    (shims / "brsmi").chmod(0o755)
    path = os.pathsep.join([str(shims), str(pathlib.Path(_our_brsmi()).parent), "/usr/bin", "/bin"])
    result = _without_emulation(path, "gpu", "list")
    assert result.returncode == 127
    assert result.stdout == ""
    assert "no Biren brsmi is installed" in result.stderr and "SUPA_EMULATE=1" in result.stderr


def test_help_lists_what_it_shows_and_the_variables(tmp_path):
    result = _without_emulation(os.pathsep.join([str(pathlib.Path(_our_brsmi()).parent), "/usr/bin", "/bin"]),
                                "--help")
    assert result.returncode == 0
    for text in ("gpu list", "SUPA_EMULATE", "SUPA_EMU_DEVICE_COUNT", "SUPA_VISIBLE_DEVICES", "SUPA_EMU_PROFILE",
                 "SUPA_EMU_MEMORY"):
        assert text in result.stdout


@emulation_only
def test_gpu_list_counts_visible_cards():
    out = brsmi("gpu", "list", SUPA_EMU_DEVICE_COUNT="4", SUPA_VISIBLE_DEVICES="2,0").stdout
    lines = [line for line in out.splitlines() if "GPU" in line]
    assert len(lines) == 2
    assert "emulated card 2" in lines[0] and "emulated card 0" in lines[1]


@emulation_only
def test_table_lists_name_and_capacity():
    out = brsmi(SUPA_EMU_DEVICE_COUNT="3", SUPA_EMU_MEMORY="16GiB").stdout
    rows = [line for line in out.splitlines() if "BR104" in line]
    assert len(rows) == 3 and all("16384MiB" in row for row in rows)


@emulation_only
def test_bad_configuration_is_reported():
    result = brsmi("gpu", "list", SUPA_EMU_DEVICE_COUNT="many")
    assert result.returncode == 2 and "SUPA_EMU_DEVICE_COUNT" in result.stderr


@emulation_only
def test_no_visible_cards_lists_none():
    result = brsmi("gpu", "list", SUPA_VISIBLE_DEVICES="-1")
    assert result.returncode == 0 and result.stdout == ""
