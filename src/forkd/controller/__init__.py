"""The forkd daemon: HTTP API, state store, snapshot and sandbox managers."""
