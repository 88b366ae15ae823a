"""What the benchmarks here share: the load average they print at start and end, the device check,
and another checkout of this project as a side of a comparison."""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import tempfile
import zlib


def load() -> str:
    return "load average " + " ".join(f"{value:.2f}" for value in os.getloadavg())


def require_supa() -> None:
    """Exit with a clear message unless a supa device exists (emulated or real)."""
    import torch  # not at import: deepspeed_step.py's driver never imports torch itself

    if not (hasattr(torch, "supa") and torch.supa.is_available()):
        raise SystemExit("no supa device: run with SUPA_EMULATE=1")


# ------------------------------------------------------------------------------------------------
# Another checkout of this project as a side of a benchmark (--against CHECKOUT)
# ------------------------------------------------------------------------------------------------
ROOT = pathlib.Path(__file__).resolve().parent.parent


def checkout_argument(parser: argparse.ArgumentParser, value: pathlib.Path | None) -> pathlib.Path | None:
    """`--against`'s value resolved, or a parser error saying why it is not another checkout."""
    if value is None:
        return None
    value = value.resolve()
    if not (value / "supa_emu" / "__init__.py").is_file() or not (value / "accelerator").is_dir():
        parser.error(f"--against {value}: not a checkout of this project (no supa_emu/ and accelerator/)")
    if value == ROOT:
        parser.error(f"--against {value}: that is this checkout")
    return value


def checkout_env(env: dict, checkout: pathlib.Path) -> dict:
    """`env` with `checkout`'s supa_emu first on the path, and its accelerator/ and op_builder/
    under the names they install as (this checkout's editable install maps those names here)."""
    # One shim per checkout: a driver may run two checkouts that are not the installed one.
    shim = pathlib.Path(tempfile.gettempdir()) / f"supa_emu_bench_checkout_{os.getpid()}_{zlib.crc32(bytes(checkout))}"
    package = shim / "supa_deepspeed"
    if not package.exists():
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
        for folder in ("accelerator", "op_builder"):
            (package / folder).symlink_to(checkout / folder, target_is_directory=True)
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), str(shim), *filter(None, [env.get("PYTHONPATH")])])
    return env


def running_checkout() -> str | None:
    """The checkout whose supa_emu this process imports (None where there is none)."""
    import importlib.util

    spec = importlib.util.find_spec("supa_emu")
    return None if spec is None else str(pathlib.Path(os.path.realpath(spec.origin)).parents[1])


def commit(checkout: pathlib.Path) -> str:
    result = subprocess.run(["git", "-C", str(checkout), "log", "-1", "--format=%h"], capture_output=True, text=True)
    return result.stdout.strip() or "not a git checkout"
