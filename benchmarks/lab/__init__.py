"""The lab: what benchmarks measure that the product does not run. Built only with ``HF_SPARSE_BUILD_LAB=1``.

* :mod:`.tuning`: the lab build's knobs (every tile configuration and pipeline of the sm_90a kernels, ``csrc/lab.h``).
* :mod:`.cslt`: the cached-plan cuSPARSELt 2:4 SpMM (``cusparselt.cpp``), the cuSPARSELt baseline.

Import with ``benchmarks/`` on ``sys.path`` (``from lab import tuning``), as the scripts in ``benchmarks/`` have it.
"""
