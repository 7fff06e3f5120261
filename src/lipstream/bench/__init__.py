"""`lipstream bench`: reproducible scenarios, the legacy baseline and the fast path, one report."""
