"""Kernels for training-time block-sparse attention: top-K block decode (scores, selection,
split-KV attention, merge) and the gate-gradient pass."""
