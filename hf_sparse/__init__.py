"""hf_sparse: N:M and VENOM V:N:M sparse training for Hugging Face Transformers.

``import hf_sparse`` registers the ``hf_sparse`` checkpoint format with Transformers (a quantization config and
an ``HfQuantizer``), so ``AutoModelFor*.from_pretrained`` loads compressed checkpoints. It touches no GPU and needs
no compiler.
"""

__version__ = "0.1.0"

from .callback import SparsityCallback  # noqa: E402
from .config import SparsityConfig  # noqa: E402
from .formats.compressed import FORMAT_VERSION, CompressedFormatError  # noqa: E402
from .integrations.quantizer import HfSparseConfig, HfSparseQuantizer  # noqa: E402
from .nn.sparse_linear import SparseLinear  # noqa: E402
from .oneshot import oneshot  # noqa: E402
from .patterns import NM, VNM, PatternError, Unstructured, parse_pattern  # noqa: E402
from .pruner import Pruner  # noqa: E402
from .serialization import compressed_state_dict, save_pretrained, to_dense  # noqa: E402
from .trainer import SparseTrainer  # noqa: E402

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
