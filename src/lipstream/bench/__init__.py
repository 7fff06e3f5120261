"""The benchmarks a user reruns (bench, live-bench, serve-bench) and their ablations' engines: only cli/ imports it."""
