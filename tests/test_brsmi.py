"""`brsmi`, the management CLI, answered for the emulated cards."""

import subprocess

import pytest

pytestmark = pytest.mark.emulation_only


def brsmi(*args, **env):
    import os
    full = dict(os.environ, **env)
    return subprocess.run(["brsmi", *args], capture_output=True, text=True, env=full, timeout=60)


def test_gpu_list_counts_visible_cards():
    out = brsmi("gpu", "list", SUPA_EMU_DEVICE_COUNT="4", SUPA_VISIBLE_DEVICES="2,0").stdout
    lines = [line for line in out.splitlines() if "GPU" in line]
    assert len(lines) == 2
    assert "emulated card 2" in lines[0] and "emulated card 0" in lines[1]


def test_table_lists_name_and_capacity():
    out = brsmi(SUPA_EMU_DEVICE_COUNT="3", SUPA_EMU_MEMORY="16GiB").stdout
    rows = [line for line in out.splitlines() if "BR104" in line]
    assert len(rows) == 3 and all("16384MiB" in row for row in rows)


def test_bad_configuration_is_reported():
    result = brsmi("gpu", "list", SUPA_EMU_DEVICE_COUNT="many")
    assert result.returncode == 2 and "SUPA_EMU_DEVICE_COUNT" in result.stderr
