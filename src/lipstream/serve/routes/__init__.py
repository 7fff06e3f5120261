"""The HTTP API's routers, plain FastAPI modules: avatars.py, jobs.py, sessions.py (serve/app.py assembles them)."""
