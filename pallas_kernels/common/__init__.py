"""Helpers shared by the kernel families: the log-sum-exp merge of partial results (merge),
the base-2 online softmax and backward row terms (softmax), shape and padding helpers (util)."""
