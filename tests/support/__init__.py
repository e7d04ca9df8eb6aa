"""Helpers shared by test suites (real processes, not mocks)."""
