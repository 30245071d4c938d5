"""CPU: the wheel's package list is complete and ships every CUDA source the extension is built from."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

from hf_sparse.ops import _build

tomllib = pytest.importorskip("tomllib")
ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_is_listed():
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "hf_sparse").rglob("__init__.py")}
    assert set(_setuptools()["packages"]) == on_disk | {"hf_sparse.csrc"}


def test_the_cuda_sources_ship_as_hf_sparse_csrc():
    cfg = _setuptools()
    assert cfg["package-dir"]["hf_sparse.csrc"] == "csrc"
    globs = cfg["package-data"]["hf_sparse.csrc"]
    for name in (*_build.SOURCES, *_build.HEADERS):
        assert (ROOT / "csrc" / name).is_file(), name
        assert any(fnmatch.fnmatch(name, g) for g in globs), name
    # the installed copy is where _build looks first
    assert _build.csrc_candidates()[0] == Path(_build.__file__).resolve().parent.parent / "csrc"
