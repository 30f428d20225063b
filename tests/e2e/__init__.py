"""The end-to-end tier (see conftest.py)."""
