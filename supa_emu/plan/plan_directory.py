"""The plan's shared directory: the files through which the planner and its rank processes meet.

The planner (play_order.py) creates it and says there which ranks it plays; each rank process
keeps there what its peers need (root_values.pt: world.py; p2p/: its point-to-point messages,
p2p_messages.py; time/: its posts of point-to-point transfers, p2p_time.py) and says what it waits
for. No torch here: the planner itself never imports it.

Files: `played.json` (the ranks played, or all-stages), `p2p/NAME` (one message), `time/posts-R`
(rank R's posts, appended a line at a time), `want-P` (a played rank exchanges messages with rank
P, or waits for it), `waiting-R` (rank R waits for what is named inside: a message or a peer's
post, as JSON), `ended-R` (rank R's process ended), `stalled` (every running rank waits for a
message no one can send). Other files appear whole (written under a hidden name, then renamed).

One wait registry serves both waits (`wait`): the planner's stall rule for messages (play_order.py)
and the crossed-wait rule for posts (p2p_time.py) read the same `waiting-R` records, and call waits
stuck when they stay the same for STUCK_S (`Unchanged`).
"""

import json
import os
import re
import time
from typing import Callable, NamedTuple, Optional, Set, Tuple, TypeVar

from supa_emu.plan.plan_error import PlanError

POLL_S = (0.0005, 0.01)  # the first and the longest pause between a waiting rank's looks
STUCK_S = 0.5  # how long waits must stay the same to be called stuck (stalled, or crossed)

Found = TypeVar("Found")


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """`write(temporary)` then a rename to `path`: readers see the whole file or none."""
    directory, name = os.path.split(path)
    temporary = os.path.join(directory, f".{name}.{os.getpid()}.tmp")  # a name no reader lists
    write(temporary)
    os.replace(temporary, path)


def message_name(group: str, source: int, destination: int, tag: int, number: int) -> str:
    """The file name of the `number`th message of its kind: GROUP.SOURCE-DESTINATION.TAG.N.pt."""
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', group)}.{source}-{destination}.{tag}.{number}.pt"


class Wait(NamedTuple):
    """What a rank waits for: a message (its file name) or a post (p2p_time.Transfer.key's) from `peer`."""

    peer: int
    message: Optional[str] = None
    post: Optional[tuple] = None

    def what(self) -> str:
        if self.message is not None:
            return f"a message from rank {self.peer}"
        return f"rank {self.peer}'s side of a point-to-point transfer"


class Unchanged:
    """Whether what is looked at (waits: None where there are none) stayed the same for STUCK_S."""

    def __init__(self):
        self._since: Optional[Tuple[float, object]] = None  # (when, what) since `what` was first seen

    def stays(self, what) -> bool:
        now = time.monotonic()
        if what is None or self._since is None or self._since[1] != what:
            self._since = None if what is None else (now, what)
            return False
        return now - self._since[0] > STUCK_S


class PlanDirectory:
    def __init__(self, path: str):
        self.path = path

    def _file(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    def _write_text(self, name: str, text: str = "") -> None:
        def write(temporary: str) -> None:
            with open(temporary, "w") as out:
                out.write(text)

        write_atomically(self._file(name), write)

    # ---- which ranks are played (written by the planner) -----------------------------------------
    def write_played(self, ranks, all_stages: bool) -> None:
        os.makedirs(self._file("p2p"), exist_ok=True)
        os.makedirs(self._file("time"), exist_ok=True)
        self._write_text("played.json", json.dumps({"ranks": sorted(ranks), "all_stages": all_stages}))

    def played(self) -> Optional[Set[int]]:
        """The ranks the plan plays, or None: any rank a played one waits for is played (all-stages)."""
        with open(self._file("played.json")) as spec:
            played = json.load(spec)
        return None if played["all_stages"] else set(played["ranks"])

    # ---- messages --------------------------------------------------------------------------------
    def message(self, name: str) -> str:
        return self._file("p2p", name)

    def write_message(self, name: str, write: Callable[[str], None]) -> None:
        """Delivers message `name`: `write(path)` writes it (whole, once renamed)."""
        write_atomically(self.message(name), write)

    def delivered(self, name: str) -> bool:
        return os.path.exists(self.message(name))

    # ---- posts of point-to-point transfers -----------------------------------------------------
    def posts(self, rank: int) -> str:
        """The file of rank `rank`'s posts (p2p_time.py appends to it, a whole line at a time)."""
        return self._file("time", f"posts-{rank}")

    # ---- who waits for whom ----------------------------------------------------------------------
    def wait(self, rank: int, wait: Wait, look: Callable[[], Optional[Found]], planner: int,
             before_waiting: Callable[[], None] = lambda: None) -> Found:
        """What `look` gives once it gives something other than None, looking again after a pause
        (POLL_S) each time; while it looks, `waiting-R` says rank `rank` waits for `wait` and the
        planner starts the peer if it can. `before_waiting` runs first where the first look fails.
        `look` may end the wait itself (raising, or giving why it goes on without); a PlanError
        where the planner (process `planner`) ended."""
        found = look()
        if found is not None:
            return found
        before_waiting()
        self._write_text(f"waiting-{rank}", json.dumps(wait._asdict()))
        self.want(wait.peer)
        try:
            pause = POLL_S[0]
            while True:
                if os.getppid() != planner:
                    raise PlanError(f"planner: rank {rank} waits for {wait.what()}, and the planner that "
                                    f"played it ended")
                time.sleep(pause)
                pause = min(pause * 2, POLL_S[1])
                found = look()
                if found is not None:
                    return found
        finally:
            os.remove(self._file(f"waiting-{rank}"))

    def want(self, peer: int) -> None:
        """A played rank exchanges messages with rank `peer`: with all-stages, the planner plays it too."""
        self._write_text(f"want-{peer}")

    def waits(self, rank: int) -> Optional[Wait]:
        """What rank `rank` waits for and has not got yet (a message not delivered, a post), or None."""
        try:
            with open(self._file(f"waiting-{rank}")) as waiting:
                wait = json.load(waiting)
        except FileNotFoundError:
            return None
        wait = Wait(wait["peer"], wait["message"], None if wait["post"] is None else tuple(wait["post"]))
        return None if wait.message is not None and self.delivered(wait.message) else wait

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
