"""Pallas kernels for jattn: pure functions of arrays with explicit block sizes (no Flax)."""
