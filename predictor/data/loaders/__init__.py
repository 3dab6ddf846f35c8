"""Loaders for the real GPU-cluster traces and for any file of the same formats.

Every loader validates as it reads: bad input raises `InputError` naming the file, the
1-based line (header = 1) and the column.
"""

from predictor.data.loaders.openb import load_openb_nodes, load_openb_pods
from predictor.data.loaders.trace import TRACE_KINDS, DemandTrace, load_trace

__all__ = ["TRACE_KINDS", "DemandTrace", "load_openb_nodes", "load_openb_pods", "load_trace"]
