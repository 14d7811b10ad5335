"""Helpers shared by the kernel families: the log-sum-exp merge of partial results."""
