"""The tensors of a transformers model directory, read from its safetensors headers alone and checked: what
`model.init_from=hf:DIR` may load. Family-independent: a family's adapter says which names and shapes it needs.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON ({name: {dtype, shape,
data_offsets}, "__metadata__": {...}}), then the data. Everything is checked before a byte of data is read:
a header length beyond the file or 100 MB, JSON that is not that, offsets outside the data or overlapping, sizes
that disagree with shape and dtype, a file that is a device or a FIFO. A failure is one ValueError line.
"""

from __future__ import annotations

import json
import math
import os
import struct

from hpctrain.core.files import FileCheckError, open_checked

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
              "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOATS = ("F16", "BF16", "F32", "F64")  # what hpctrain converts to its fp32 weights without loss of meaning
DCP_SHARDING_KEY = "DCP_SHARDING_INFO"  # torch's sharded safetensors writer: not a transformers model's layout


def _header(file: str) -> dict:
    try:
        with open_checked(file, 2**62) as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{file} is {size} bytes: too short for a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"{file} declares a {n:,}-byte header in a {size:,}-byte file (truncated or not "
                                 "safetensors)")
            header = json.loads(f.read(n).decode("utf-8"))
    except FileCheckError as e:
        raise ValueError(str(e)) from None
    except UnicodeDecodeError:
        raise ValueError(f"{file}: its header is not UTF-8 JSON (not safetensors)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: its header is not JSON ({e.msg} at {e.pos}; truncated or not safetensors)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: its header is not a JSON object (not safetensors)")
    return _checked(file, header, size - 8 - n)


def _checked(file: str, header: dict, data_bytes: int) -> dict:
    """{name: (dtype, shape)} once every entry is well formed and the entries tile the data without overlap."""
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or DCP_SHARDING_KEY in meta:
        raise ValueError(f"{file}: its __metadata__ is not a transformers model's (DCP sharding info, or not an "
                         "object)")
    out, spans = {}, []
    for name, entry in header.items():
        ok = isinstance(entry, dict) and entry.get("dtype") in ITEM_BYTES and isinstance(entry.get("shape"), list) \
            and all(type(d) is int and d >= 0 for d in entry["shape"]) and isinstance(entry.get("data_offsets"), list) \
            and len(entry["data_offsets"]) == 2 and all(type(o) is int for o in entry["data_offsets"])
        if not ok:
            raise ValueError(f"{file}: entry {name!r} is not a safetensors tensor entry (dtype, shape, data_offsets)")
        begin, end = entry["data_offsets"]
        want = math.prod(entry["shape"]) * ITEM_BYTES[entry["dtype"]]
        if not 0 <= begin <= end <= data_bytes or end - begin != want:
            raise ValueError(f"{file}: tensor {name} spans bytes {begin}..{end} of {data_bytes:,} bytes of data, its "
                             f"shape and dtype need {want:,} (truncated or damaged)")
        spans.append((begin, end, name))
        out[name] = (entry["dtype"], tuple(entry["shape"]))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise ValueError(f"{file}: tensors {a} and {b} overlap (damaged)")
    return out


INDEX = "model.safetensors.index.json"


def weight_files(path: str) -> list[str]:
    """The model's safetensors files in directory `path`: those its model.safetensors.index.json maps tensors to, as
    transformers reads them (Mistral's repositories also hold a consolidated.safetensors under names of their own),
    else every *.safetensors file. A file the index lists that is not there is one ValueError line."""
    from hpctrain.core.files import MAX_JSON_BYTES, FileCheckError, read_json

    if not os.path.lexists(os.path.join(path, INDEX)):
        return sorted(e for e in os.listdir(path) if e.endswith(".safetensors"))
    try:
        weight_map = read_json(os.path.join(path, INDEX), MAX_JSON_BYTES).get("weight_map")
    except (OSError, FileCheckError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}/{INDEX} is not a safetensors index ({' '.join(str(e).split())}): download it "
                         "again") from None
    files = sorted(set(weight_map.values())) if isinstance(weight_map, dict) else None
    if not files or not all(isinstance(f, str) and f.endswith(".safetensors") and os.path.basename(f) == f
                            for f in files):
        raise ValueError(f"{path}/{INDEX} maps no tensors to safetensors files of its directory: download it again")
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise ValueError(f"{path}/{missing[0]}, listed in {INDEX}, is missing ({len(missing)} of {len(files)} "
                         "files): download it again")
    return files


def tensors(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (safetensors dtype, shape)} of the model's safetensors files in directory `path` (`weight_files`),
    checked."""
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for entry in weight_files(path):
        for name, spec in _header(os.path.join(path, entry)).items():
            if name in found:
                raise ValueError(f"{path}: tensor {name} is in two safetensors files")
            found[name] = spec
    return found


def check_tensors(path: str, expected: dict[str, tuple[int, ...]], optional: tuple[str, ...] = (),
                  ignored: tuple[str, ...] = ()) -> None:
    """The directory's tensors are exactly `expected` ({name: shape}), floating point: every one present with
    its shape, nothing else but names in `optional` or ending in one of `ignored`. One ValueError line naming the
    first difference and the fix."""
    found = tensors(path)
    for name, shape in expected.items():
        if name not in found:
            if name in optional:
                continue
            raise ValueError(f"{path} has no tensor {name}: its weights are not the model its config.json describes")
        dtype, theirs = found[name]
        if theirs != tuple(shape):
            raise ValueError(f"{path}: tensor {name} is {list(theirs)}, the model its config.json describes needs "
                             f"{list(shape)}")
        if dtype not in FLOATS:
            raise ValueError(f"{path}: tensor {name} is {dtype} (quantized?): hpctrain trains floating-point weights "
                             f"({', '.join(FLOATS)}); start from the unquantized checkpoint")
    extra = sorted(n for n in found if n not in expected and not n.endswith(ignored))
    if extra:
        raise ValueError(f"{path} holds {extra[0]}{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}, which "
                         "the model its config.json describes has not: the config and the weights disagree")
