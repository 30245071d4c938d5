from .sparse_linear import SparseLinear

__all__ = ["SparseLinear"]
