"""The plan's shared directory: the files through which the planner and its rank processes meet.

The planner (play_order.py) creates it and says there which ranks it plays; each rank process
keeps there what its peers need (root_values.pt: world.py; p2p/: its point-to-point messages,
p2p_messages.py) and says which message it waits for. No torch here: the planner itself never
imports it.

Files: `played.json` (the ranks played, or all-stages), `p2p/NAME` (one message), `want-P` (a
played rank exchanges messages with rank P, or waits for it), `waiting-R` (rank R waits for the
message named inside), `ended-R` (rank R's process ended), `stalled` (every running rank waits for
a message no one can send). A file appears whole (written under a hidden name, then renamed).
"""

import json
import os
import re
from typing import Callable, Optional, Set


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """`write(temporary)` then a rename to `path`: readers see the whole file or none."""
    directory, name = os.path.split(path)
    temporary = os.path.join(directory, f".{name}.{os.getpid()}.tmp")  # a name no reader lists
    write(temporary)
    os.replace(temporary, path)


def message_name(group: str, source: int, destination: int, tag: int, number: int) -> str:
    """The file name of the `number`th message of its kind: GROUP.SOURCE-DESTINATION.TAG.N.pt."""
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', group)}.{source}-{destination}.{tag}.{number}.pt"


def message_sender(name: str) -> int:
    """The global rank that sends the message `name` (message_name's)."""
    return int(name.split(".")[1].split("-")[0])


class PlanDirectory:
    def __init__(self, path: str):
        self.path = path

    def _file(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    def write_atomically(self, path: str, write: Callable[[str], None]) -> None:
        write_atomically(path, write)

    def _write_text(self, name: str, text: str = "") -> None:
        def write(temporary: str) -> None:
            with open(temporary, "w") as out:
                out.write(text)

        self.write_atomically(self._file(name), write)

    # ---- which ranks are played (written by the planner) -----------------------------------------
    def write_played(self, ranks, all_stages: bool) -> None:
        os.makedirs(self._file("p2p"), exist_ok=True)
        self._write_text("played.json", json.dumps({"ranks": sorted(ranks), "all_stages": all_stages}))

    def played(self) -> Optional[Set[int]]:
        """The ranks the plan plays, or None: any rank a played one waits for is played (all-stages)."""
        with open(self._file("played.json")) as spec:
            played = json.load(spec)
        return None if played["all_stages"] else set(played["ranks"])

    # ---- messages --------------------------------------------------------------------------------
    def message(self, name: str) -> str:
        return self._file("p2p", name)

    def delivered(self, name: str) -> bool:
        return os.path.exists(self.message(name))

    # ---- who waits for whom ----------------------------------------------------------------------
    def wait_for(self, rank: int, name: str, source: int) -> None:
        """Rank `rank` waits for message `name` from rank `source` (which the planner starts if it can)."""
        self._write_text(f"waiting-{rank}", name)
        self.want(source)

    def want(self, peer: int) -> None:
        """A played rank exchanges messages with rank `peer`: with all-stages, the planner plays it too."""
        self._write_text(f"want-{peer}")

    def done_waiting(self, rank: int) -> None:
        os.remove(self._file(f"waiting-{rank}"))

    def waits(self, rank: int) -> Optional[str]:
        """The message rank `rank` waits for, or None."""
        try:
            with open(self._file(f"waiting-{rank}")) as waiting:
                return waiting.read()
        except FileNotFoundError:
            return None

    def wanted(self) -> Set[int]:
        """The ranks that played ranks wait for."""
        return {int(entry[len("want-"):]) for entry in os.listdir(self.path) if entry.startswith("want-")}

    # ---- the end of a rank, and of waiting -------------------------------------------------------
    def mark_ended(self, rank: int) -> None:
        self._write_text(f"ended-{rank}")

    def ended(self, rank: int) -> bool:
        return os.path.exists(self._file(f"ended-{rank}"))

    def mark_stalled(self) -> None:
        self._write_text("stalled")

    def stalled(self) -> bool:
        return os.path.exists(self._file("stalled"))
