"""`brsmi`: the Biren management CLI, answered for the emulated cards.

Tooling and test harnesses count cards with `brsmi gpu list` (one line containing `GPU`
per card); plain `brsmi` prints a table of the visible cards with name and memory.
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="brsmi", description="Biren SUPA management (emulated cards)")
    sub = parser.add_subparsers(dest="group")
    gpu = sub.add_parser("gpu", help="card queries")
    gpu.add_argument("action", choices=["list"], help="list the visible cards, one line each")
    args = parser.parse_args(argv)
    try:
        cfg = config.load()
    except config.ConfigError as error:
        print(f"brsmi: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(gpu_list(cfg) if args.group == "gpu" else table(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
