"""`lipstream serve`: the HTTP API (FastAPI) with its job store and runner, live WebRTC sessions and metrics."""
