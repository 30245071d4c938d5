"""``hf-sparse inspect DIR``: what a saved checkpoint holds, layer by layer, without loading the model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .formats.compressed import CompressedFormatError, validate
from .formats.safetensors_header import DTYPE_BYTES, read_safetensors_header
from .patterns import Unstructured, parse_pattern

__all__ = ["format_inspection", "inspect_checkpoint"]


def _tensor_bytes(entry: dict[str, Any]) -> int:
    start, end = entry["data_offsets"]
    return int(end - start)


def _validate_layer(name: str, keys: list[str], file_of: dict[str, Path], pattern, shape: tuple[int, int]) -> None:
    """Read one compressed layer's tensors and check them against its pattern (positions in range, in order)."""
    from safetensors import safe_open

    tensors = {}
    for key in keys:
        with safe_open(file_of[key], framework="pt") as fh:
            tensors[key[len(name) + 1 :]] = fh.get_tensor(key)
    try:
        validate(tensors, pattern, shape, prefix=name)
    except CompressedFormatError as err:
        raise CompressedFormatError(
            f"{file_of[keys[0]]}: {err}; the file is corrupt: copy or download it again"
        ) from None


def inspect_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Per pruned layer: pattern, sparsity, compressed bytes and the bytes the dense weight would take.

    Raises ``FileNotFoundError`` or ``ValueError`` (naming the file and the problem) for a folder that is not an
    hf_sparse checkpoint or whose files are truncated or corrupt: every header is checked against its file's size
    and every compressed layer against its pattern.
    """
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder}: no config.json; is this a saved model folder?")
    try:
        saved = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_file}: not valid JSON ({err}); the file is corrupt or truncated") from None
    quant = (saved.get("quantization_config") if isinstance(saved, dict) else None) or {}
    if not isinstance(quant, dict) or quant.get("quant_method") != "hf_sparse":
        raise ValueError(f"{folder}: config.json has no hf_sparse quantization_config; the checkpoint is dense")
    header: dict[str, Any] = {}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors files")
    file_of: dict[str, Path] = {}
    for file in files:
        entries = {k: v for k, v in read_safetensors_header(file).items() if k != "__metadata__"}
        header.update(entries)
        file_of.update(dict.fromkeys(entries, file))
    rows_out = []
    pruned_bytes = pruned_dense = kept = total = 0
    for name, spec in quant.get("layers", {}).items():
        try:
            pattern = parse_pattern(spec["pattern"])
            rows, cols = (int(x) for x in spec["shape"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(
                f"{config_file}: quantization_config.layers[{name!r}] = {spec!r} is malformed ({err}); the file is "
                "corrupt or was edited by hand"
            ) from None
        values = header.get(f"{name}.weight")
        if values is None:
            raise ValueError(f"{folder}: {name}.weight listed in quantization_config but missing from the files")
        keys = [k for k in header if k.startswith(f"{name}.weight")]
        _validate_layer(name, keys, file_of, pattern, (rows, cols))
        element = DTYPE_BYTES.get(values["dtype"], 2)
        layer_bytes = sum(_tensor_bytes(header[k]) for k in keys)
        dense_bytes = rows * cols * element
        nnz = spec.get("nnz") if isinstance(pattern, Unstructured) else rows * cols * (1 - pattern.sparsity)
        sparsity = 1 - float(nnz) / (rows * cols)
        rows_out.append(
            {
                "layer": name,
                "pattern": str(pattern) + (" T" if spec.get("transposable") else ""),
                "shape": [rows, cols],
                "dtype": values["dtype"],
                "sparsity": sparsity,
                "bytes": layer_bytes,
                "dense_bytes": dense_bytes,
            }
        )
        pruned_bytes += layer_bytes
        pruned_dense += dense_bytes
        kept += float(nnz)
        total += rows * cols
    file_bytes = sum(os.path.getsize(f) for f in files)
    return {
        "path": str(folder),
        "format_version": quant.get("format_version"),
        "hf_sparse_version": quant.get("hf_sparse_version"),
        "layers": rows_out,
        "pruned_bytes": pruned_bytes,
        "pruned_dense_bytes": pruned_dense,
        "pruned_sparsity": 1 - kept / total if total else 0.0,
        "file_bytes": file_bytes,
        "file_dense_bytes": file_bytes - pruned_bytes + pruned_dense,
    }


def format_inspection(info: dict[str, Any]) -> str:
    """A fixed-width table of :func:`inspect_checkpoint`'s result."""
    width = max([len("layer")] + [len(r["layer"]) for r in info["layers"]])
    lines = [
        f"{info['path']}: hf_sparse format {info['format_version']} (written by hf_sparse {info['hf_sparse_version']})",
        f"{'layer':<{width}}  {'pattern':>10}  {'shape':>11}  {'dtype':>5}  {'sparsity':>8}  {'bytes':>10}  "
        f"{'dense':>10}  {'ratio':>6}",
    ]
    for r in info["layers"]:
        shape = "x".join(map(str, r["shape"]))
        lines.append(
            f"{r['layer']:<{width}}  {r['pattern']:>10}  {shape:>11}  {r['dtype']:>5}  {r['sparsity']:>8.3f}  "
            f"{r['bytes']:>10,}  {r['dense_bytes']:>10,}  {r['bytes'] / r['dense_bytes']:>6.1%}"
        )
    lines.append(
        f"pruned layers: {info['pruned_bytes']:,} bytes vs {info['pruned_dense_bytes']:,} dense "
        f"({info['pruned_bytes'] / max(1, info['pruned_dense_bytes']):.1%}), sparsity {info['pruned_sparsity']:.3f}"
    )
    lines.append(
        f"whole checkpoint: {info['file_bytes']:,} bytes vs {info['file_dense_bytes']:,} dense "
        f"({info['file_bytes'] / max(1, info['file_dense_bytes']):.1%})"
    )
    return "\n".join(lines)
