"""Docs generated from the code, so the tables in ``docs/`` cannot drift from it."""
