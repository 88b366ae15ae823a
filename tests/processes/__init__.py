"""How harness.py (fresh processes) and ranks.py (N ranks) start what the tests run: jobs in sessions of
their own, interpreters forked from one that imported torch already, interpreters shared by several
functions, launcher commands. Test files call harness.py and ranks.py, not these modules."""
