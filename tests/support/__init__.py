"""Helpers shared by the tests, imported as ``support.<module>`` (tests/ is on ``sys.path``
through its conftest.py; spawned ranks inherit that path)."""
