"""Shared fixtures. setup.cfg's ``pythonpath`` puts the repository root and tests/ on sys.path."""
