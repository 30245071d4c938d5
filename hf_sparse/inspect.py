"""``hf-sparse inspect DIR``: what a saved checkpoint holds, layer by layer, without loading the model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .integrations.quantizer import _read_safetensors_header
from .patterns import Unstructured, parse_pattern

__all__ = ["format_inspection", "inspect_checkpoint"]

_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "BF16": 2,
    "F16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U8": 1,
    "I8": 1,
    "I32": 4,
    "I64": 8,
}


def _tensor_bytes(entry: dict[str, Any]) -> int:
    start, end = entry["data_offsets"]
    return int(end - start)


def inspect_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Per pruned layer: pattern, sparsity, compressed bytes and the bytes the dense weight would take."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder}: no config.json; is this a saved model folder?")
    quant = json.loads(config_file.read_text()).get("quantization_config") or {}
    if quant.get("quant_method") != "hf_sparse":
        raise ValueError(f"{folder}: config.json has no hf_sparse quantization_config; the checkpoint is dense")
    header: dict[str, Any] = {}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors files")
    for file in files:
        header.update({k: v for k, v in _read_safetensors_header(str(file)).items() if k != "__metadata__"})
    rows_out = []
    pruned_bytes = pruned_dense = kept = total = 0
    for name, spec in quant.get("layers", {}).items():
        pattern = parse_pattern(spec["pattern"])
        rows, cols = spec["shape"]
        values = header.get(f"{name}.weight")
        if values is None:
            raise ValueError(f"{folder}: {name}.weight listed in quantization_config but missing from the files")
        element = _DTYPE_BYTES.get(values["dtype"], 2)
        layer_bytes = sum(_tensor_bytes(e) for k, e in header.items() if k.startswith(f"{name}.weight"))
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
