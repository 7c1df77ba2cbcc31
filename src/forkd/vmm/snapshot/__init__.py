"""A VM's state on disk: writing a snapshot (full, live or diff, with the failure
table), its files and record, copying and compacting snapshots, and the memory
tools under them (page dumps, diffs, write tracking)."""
