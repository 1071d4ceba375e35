"""Helpers the tests share: launching ranks, oracles, models, data functions, log checks."""
