"""The tests' and benchmarks' helpers (not shipped): tests/ is on pytest's path
(pyproject.toml's ``pythonpath``), so test modules import ``support.<module>``."""
