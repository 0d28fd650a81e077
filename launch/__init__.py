"""The ``elastic-run`` launcher (no public Python API; use the console script)."""
