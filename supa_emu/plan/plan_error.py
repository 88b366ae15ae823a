"""The error a planned rank fails with: the script asks for what a planned world cannot give."""


class PlanError(RuntimeError):
    """The script asks for something a planned world cannot give (one line, naming the problem)."""
