"""Helpers shared by the kernel families: merge, softmax, walk, and util (shapes, padding)."""
