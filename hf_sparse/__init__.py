"""hf_sparse: N:M and VENOM V:N:M sparse training for Hugging Face Transformers.

``import hf_sparse`` registers the ``hf_sparse`` checkpoint format with Transformers (a quantization config and
an ``HfQuantizer``), so ``AutoModelFor*.from_pretrained`` loads compressed checkpoints. It touches no GPU and needs
no compiler.
"""

from ._version import __version__
from .callback import SparsityCallback
from .config import SparsityConfig
from .formats.compressed import FORMAT_VERSION, CompressedFormatError
from .integrations.quantizer import HfSparseConfig, HfSparseQuantizer
from .nn.convert import to_dense
from .nn.sparse_linear import SparseLinear
from .oneshot import oneshot
from .patterns import NM, VNM, PatternError, Unstructured, parse_pattern
from .pruner import Pruner
from .serialization import compressed_state_dict, save_pretrained
from .trainer import SparseTrainer

__all__ = [
    "FORMAT_VERSION",
    "NM",
    "VNM",
    "CompressedFormatError",
    "HfSparseConfig",
    "HfSparseQuantizer",
    "PatternError",
    "Pruner",
    "SparseLinear",
    "SparseTrainer",
    "SparsityCallback",
    "SparsityConfig",
    "Unstructured",
    "__version__",
    "compressed_state_dict",
    "oneshot",
    "parse_pattern",
    "save_pretrained",
    "to_dense",
]
