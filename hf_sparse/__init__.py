"""hf_sparse: N:M and VENOM V:N:M sparse training for Hugging Face Transformers."""

__version__ = "0.1.0"
