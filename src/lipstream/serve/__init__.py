"""`lipstream serve`: render jobs on a GPU next to live sessions, behind one FastAPI service."""
