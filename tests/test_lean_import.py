import subprocess
import sys


def test_import_touches_no_gpu_and_no_compiler():
    code = (
        "import torch, sys\n"
        "import hf_sparse\n"
        "assert not torch.cuda.is_initialized(), 'import hf_sparse initialised CUDA'\n"
        "assert 'torch.utils.cpp_extension' not in sys.modules, 'import hf_sparse loaded the extension builder'\n"
        "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING\n"
        "assert 'hf_sparse' in AUTO_QUANTIZER_MAPPING\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
