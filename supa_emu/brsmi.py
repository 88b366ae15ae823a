"""`brsmi`: the Biren management CLI, answered for the emulated cards.

Tooling and test harnesses count cards with `brsmi gpu list` (one line containing `GPU`
per card); plain `brsmi` prints a table of the visible cards with name and memory.

Without SUPA_EMULATE this command must not pretend: installed next to Biren's real tool, it
hands the call over to the next `brsmi` on PATH, or says that none is installed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from supa_emu import config


def _cards(cfg: config.EmulatorConfig):
    for index, physical in enumerate(cfg.visible_devices):
        yield index, physical, cfg.profile.uuid_bytes(physical).hex()


def gpu_list(cfg: config.EmulatorConfig) -> str:
    return "".join(f"GPU {index}: {cfg.profile.name} (UUID: GPU-{uuid}) [emulated card {physical}]\n"
                   for index, physical, uuid in _cards(cfg))


def table(cfg: config.EmulatorConfig) -> str:
    mib = cfg.memory_bytes // (1 << 20)
    rule = "+" + "-" * 6 + "+" + "-" * 24 + "+" + "-" * 22 + "+\n"
    lines = [rule, f"| {'GPU':<4} | {'Name':<22} | {'Memory':<20} |\n", rule]
    for index, _physical, _uuid in _cards(cfg):
        lines.append(f"| {index:<4} | {cfg.profile.name + ' (emulated)':<22} | {f'0MiB / {mib}MiB':<20} |\n")
    lines.append(rule)
    return "".join(lines)


_EPILOG = """\
what it shows (emulated cards only, with SUPA_EMULATE=1):
  brsmi            a table of the visible cards: index, name, memory used / capacity
                   (used is always 0MiB: every process accounts for its own emulated memory)
  brsmi gpu list   one line per visible card: "GPU <index>: <name> (UUID: GPU-...) [emulated card <id>]"

variables that shape it:
  SUPA_EMULATE           1 to answer for emulated cards; unset/0: run the real brsmi found later on PATH
  SUPA_EMU_DEVICE_COUNT  number of emulated cards (8)
  SUPA_VISIBLE_DEVICES   which cards are listed, in that order (empty or -1: none)
  SUPA_EMU_PROFILE       card model: BR104 or BR100 (BR104)
  SUPA_EMU_MEMORY        capacity shown for each card (the profile's memory)
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="brsmi", description="Biren SUPA management CLI of supa-emu: lists the "
                                     "emulated SUPA cards", epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="group")
    gpu = sub.add_parser("gpu", help="card queries")
    gpu.add_argument("action", choices=["list"], help="list the visible cards, one line each")
    return parser


# Names, by real path, the tools already handed over to in this chain of execs. A launcher shim
# (pyenv, asdf) on PATH runs this script again; without the record it would be handed over to forever.
_TRIED = "_SUPA_EMU_BRSMI_TRIED"


def _is_this_tool(path: str) -> bool:
    """True for this project's own `brsmi` (this script, or its wrapper in another environment)."""
    if sys.argv and sys.argv[0] and os.path.realpath(path) == os.path.realpath(sys.argv[0]):
        return True
    try:
        with open(path, "rb") as f:
            return b"supa_emu.brsmi" in f.read(4096)  # pip's console-script wrapper names its module
    except OSError:
        return True  # unreadable: do not exec it


def real_brsmi() -> str | None:
    """The first `brsmi` on PATH that is not this project's and was not tried already, or None."""
    tried = set(filter(None, os.environ.get(_TRIED, "").split(os.pathsep)))
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidate = shutil.which("brsmi", path=directory or os.curdir)
        if candidate is not None and os.path.realpath(candidate) not in tried and not _is_this_tool(candidate):
            return candidate
    return None


def _hand_over(argv: list[str]) -> int:
    real = real_brsmi()
    if real is not None:
        tried = os.environ.get(_TRIED, "")
        env = dict(os.environ, **{_TRIED: os.pathsep.join(filter(None, [tried, os.path.realpath(real)]))})
        os.execve(real, [real, *argv], env)  # does not return
    if any(arg in ("-h", "--help") for arg in argv):
        _parser().print_help()
        return 0
    print("brsmi: no Biren brsmi is installed on this machine (none found on PATH besides supa-emu's). "
          "supa-emu's brsmi lists emulated cards only when emulation is on: run `SUPA_EMULATE=1 brsmi` "
          "(see `brsmi --help`).", file=sys.stderr)
    return 127


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        emulated = config.emulation_requested()
    except config.ConfigError as error:
        print(f"brsmi: {error}", file=sys.stderr)
        return 2
    if not emulated:
        return _hand_over(argv)
    args = _parser().parse_args(argv)
    try:
        cfg = config.load()
    except config.ConfigError as error:
        print(f"brsmi: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(gpu_list(cfg) if args.group == "gpu" else table(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
