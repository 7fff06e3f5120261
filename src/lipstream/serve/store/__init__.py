"""The job store of `lipstream serve`: base.py (what every store does), sqlite.py (one machine, the default),
postgres.py (replicas on several machines), database.py (which store a `--database` names)."""
