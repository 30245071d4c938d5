"""Read and check the header of a ``.safetensors`` file without reading its tensors.

A safetensors file is an 8-byte little-endian header length, a JSON header (tensor name -> dtype, shape and
``data_offsets`` into the data that follows; ``__metadata__`` -> string pairs), then the data. The checks here are
what a truncated or overwritten file fails: a header that does not fit the file, is not JSON, or lists tensors
whose bytes lie outside the data or disagree with their dtype and shape.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

from .compressed import CompressedFormatError

__all__ = ["DTYPE_BYTES", "read_safetensors_header"]

#: Bytes per element of the safetensors dtypes a Transformers checkpoint holds.
DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "BF16": 2,
    "F16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U8": 1,
    "I8": 1,
    "BOOL": 1,
    "U16": 2,
    "I16": 2,
    "U32": 4,
    "I32": 4,
    "U64": 8,
    "I64": 8,
}


def read_safetensors_header(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON header of the safetensors file at ``path`` (``__metadata__`` included), checked against its size.

    Raises :class:`~hf_sparse.formats.compressed.CompressedFormatError` (a ``ValueError``) naming the file and what
    is wrong when it is truncated or corrupt.
    """
    size = os.path.getsize(path)
    where = f"{os.fspath(path)} ({size:,} bytes)"
    redo = "the file is truncated or corrupt: copy or download it again"
    if size < 8:
        raise CompressedFormatError(f"{where}: too short for a safetensors header; {redo}")
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        if length > size - 8:
            raise CompressedFormatError(f"{where}: header of {length:,} bytes does not fit in the file; {redo}")
        raw = fh.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CompressedFormatError(f"{where}: header is not valid JSON ({err}); {redo}") from None
    if not isinstance(header, dict):
        raise CompressedFormatError(f"{where}: header is a JSON {type(header).__name__}, not an object; {redo}")
    data_bytes = size - 8 - length
    end_of_tensors = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = (int(x) for x in entry["data_offsets"])
            count = math.prod(int(x) for x in entry["shape"])
            element = DTYPE_BYTES.get(entry["dtype"])  # None: a dtype this table does not know, size unchecked
        except (KeyError, TypeError, ValueError) as err:
            raise CompressedFormatError(
                f"{where}: tensor {name!r} has a malformed header entry ({err!r}); {redo}"
            ) from None
        if not 0 <= start <= end <= data_bytes:
            raise CompressedFormatError(
                f"{where}: tensor {name!r} lies at bytes [{start}, {end}) of a data section of {data_bytes:,} bytes; "
                f"{redo}"
            )
        if element is not None and end - start != count * element:
            raise CompressedFormatError(
                f"{where}: tensor {name!r} ({entry['dtype']} {entry['shape']}) needs {count * element:,} bytes, "
                f"the header gives it {end - start:,}; {redo}"
            )
        end_of_tensors = max(end_of_tensors, end)
    if end_of_tensors != data_bytes:
        raise CompressedFormatError(
            f"{where}: the tensors end at data byte {end_of_tensors:,} but the data section has {data_bytes:,}; {redo}"
        )
    return header
