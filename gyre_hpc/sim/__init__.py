"""Discrete-event simulator of a cluster of cells, running the same scheduler policies."""
