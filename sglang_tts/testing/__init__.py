"""Helpers for the tests only (reference generation, sampling checks): nothing in the library or the
scripts imports this package (tests/test_layering.py).
"""
