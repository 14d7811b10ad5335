"""Kernels for training-time block-sparse attention: the top-K block decode kernel."""
