"""Runs several training scripts one after the other in one process, each in a planner section.

    setups.py '[[name, script, *args], ...]'

Every setup in one job (tests/script_sequence.py): the fixed cost of a rank process (importing
torch, DeepSpeed, transformers) is paid once per job rather than once per setup (tests/test_plan.py's
exactness jobs). What earlier setups leave allocated is left alike in the real job and the plan.
"""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # tests/, for script_sequence

import script_sequence  # noqa: E402

from supa_emu.plan import section  # noqa: E402

script_sequence.run(json.loads(sys.argv[1]), around=section)
