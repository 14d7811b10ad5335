"""Exact log-sum-exp merge of partial attention results (see ``pallas_kernels.common.merge``)."""
from pallas_kernels.common.merge import merge, merge_partials

__all__ = ["merge_partials", "merge"]
