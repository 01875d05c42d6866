"""Environments of multi-turn episodes: the `Environment` protocol users implement, and tools."""
