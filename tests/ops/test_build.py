"""CPU: where the extension's sources are found, what the product and lab builds compile with, and when a load
compiles (hf_sparse.ops._build)."""

from __future__ import annotations

import os
import re
import shutil

import pytest

from hf_sparse.ops import _build

from ._helpers import fake_compiler


def test_the_checkout_holds_every_source_and_each_include_is_listed():
    src = _build.csrc_dir()
    for name in (*_build.SOURCES, *_build.HEADERS):
        assert (src / name).is_file(), name
    # every local #include of the sources (and of what they include) is one of HEADERS, so an install that ships the
    # listed files can build
    seen, todo = set(), list(_build.SOURCES)
    while todo:
        name = todo.pop()
        for inc in re.findall(r'#include "([^"]+)"', (src / name).read_text()):
            if inc not in seen:
                seen.add(inc)
                todo.append(inc)
    assert seen <= set(_build.HEADERS), seen - set(_build.HEADERS)


def _fill(folder, names):
    folder.mkdir(parents=True)
    for name in names:
        (folder / name).write_text("// source\n")


def test_sources_are_looked_for_in_the_installed_package_first(tmp_path, monkeypatch):
    installed, checkout = tmp_path / "site" / "hf_sparse" / "csrc", tmp_path / "repo" / "csrc"
    monkeypatch.setattr(_build, "csrc_candidates", lambda: (installed, checkout))
    everything = (*_build.SOURCES, *_build.HEADERS)
    _fill(checkout, everything)
    assert _build.csrc_dir() == checkout  # nothing installed: the checkout
    _fill(installed, everything[:-1])
    assert _build.csrc_dir() == checkout  # an incomplete install is skipped
    (installed / everything[-1]).write_text("// header\n")
    assert _build.csrc_dir() == installed
    shutil.rmtree(checkout)
    shutil.rmtree(installed)
    with pytest.raises(_build.KernelUnavailableError, match=f"not found in {re.escape(str(installed))}, .*reinstall"):
        _build.csrc_dir()


def test_the_real_candidates_are_the_package_then_the_checkout():
    installed, checkout = _build.csrc_candidates()
    package = os.path.dirname(os.path.dirname(os.path.abspath(_build.__file__)))
    assert str(installed) == os.path.join(package, "csrc")
    assert str(checkout) == os.path.join(os.path.dirname(package), "csrc")


def test_product_and_lab_builds_differ_by_the_lab_define_and_their_cache_entry():
    product, lab = _build.build_flags(["9.0"]), _build.build_flags(["9.0"], lab=True)
    assert "-DHF_SPARSE_LAB" not in product
    assert [f for f in lab if f != "-DHF_SPARSE_LAB"] == product
    assert "-gencode=arch=compute_90a,code=sm_90a" in product and "-DHF_SPARSE_HAS_SM90A" in product
    assert _build.build_flags(["9.0"], extra=("-DX=1",))[-1] == "-DX=1"
    names = {
        _build._extension_name(False, ()),
        _build._extension_name(True, ()),
        _build._extension_name(False, ("-DX=1",)),
        _build._extension_name(True, ("-DX=1",)),
    }
    assert len(names) == 4 and _build._extension_name(False, ()) == "hf_sparse_C"


@pytest.mark.parametrize(("value", "lab"), [(None, False), ("0", False), ("", False), ("1", True)])
def test_lab_build_flag(value, lab, monkeypatch):
    if value is None:
        monkeypatch.delenv("HF_SPARSE_BUILD_LAB", raising=False)
    else:
        monkeypatch.setenv("HF_SPARSE_BUILD_LAB", value)
    assert _build.lab_build.__wrapped__() is lab


def test_lab_build_flag_refuses_other_values(monkeypatch):
    monkeypatch.setenv("HF_SPARSE_BUILD_LAB", "yes")
    with pytest.raises(_build.KernelUnavailableError, match="HF_SPARSE_BUILD_LAB='yes'; use 1"):
        _build.lab_build.__wrapped__()


def test_a_load_compiles_when_the_library_is_missing_or_older_than_a_source(tmp_path):
    src = tmp_path / "csrc"
    _fill(src, (*_build.SOURCES, *_build.HEADERS))
    library = tmp_path / "hf_sparse_C.so"
    assert _build._stale(library, src)
    library.write_bytes(b"\x7fELF")
    old = library.stat().st_mtime - 100
    for name in (*_build.SOURCES, *_build.HEADERS):
        os.utime(src / name, (old, old))
    assert not _build._stale(library, src)
    os.utime(src / "tile_config.h", (old + 200, old + 200))
    assert _build._stale(library, src)


def test_each_extension_builds_in_its_own_folder(tmp_path, monkeypatch):
    # The product and the lab extension built at once into one HF_SPARSE_BUILD_DIR must not share a build.ninja
    # (one overwrote the other's, and the product build failed): each gets a subfolder named after it.
    folders = {}

    def fake_compile(**kwargs):
        folders[kwargs["name"]] = kwargs["build_directory"]
        raise RuntimeError("no nvcc here")

    fake_compiler(monkeypatch, tmp_path, fake_compile)
    for lab in (False, True):
        monkeypatch.setattr(_build, "lab_build", lambda lab=lab: lab)
        with pytest.raises(_build.KernelUnavailableError):
            _build.load_extension.__wrapped__()
    assert folders == {
        "hf_sparse_C": str(tmp_path / "hf_sparse_C"),
        "hf_sparse_C_lab": str(tmp_path / "hf_sparse_C_lab"),
    }
    assert all(os.path.isdir(folder) for folder in folders.values())
