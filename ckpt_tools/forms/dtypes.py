"""The element types the on-disk forms hold, one record each: torch's name for it (the name every module speaks), its
bytes per element, torch.save's storage class in a pickle (read and written without torch) and the safetensors
header's code. The tables the readers and writers look names up in are derived from these records."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str  # torch's: "bfloat16"
    size: int  # bytes per element
    storage: str | None  # torch.save's storage class ("BFloat16Storage"); None: no class of its own
    safetensors: str  # the safetensors header's code ("BF16")


ALL = (DType("float32", 4, "FloatStorage", "F32"), DType("bfloat16", 2, "BFloat16Storage", "BF16"),
       DType("float16", 2, "HalfStorage", "F16"), DType("float64", 8, "DoubleStorage", "F64"),
       DType("int64", 8, "LongStorage", "I64"), DType("int32", 4, "IntStorage", "I32"),
       DType("int16", 2, "ShortStorage", "I16"), DType("int8", 1, "CharStorage", "I8"),
       DType("uint8", 1, "ByteStorage", "U8"), DType("bool", 1, "BoolStorage", "BOOL"),
       DType("float8_e4m3fn", 1, None, "F8_E4M3"))

ELEMENT_SIZES = {d.name: d.size for d in ALL}  # "bfloat16" -> 2
STORAGE_CLASSES = {d.name: d.storage for d in ALL if d.storage}  # "bfloat16" -> "BFloat16Storage"
STORAGE_DTYPES = {d.storage: d.name for d in ALL if d.storage}  # "BFloat16Storage" -> "bfloat16"
SAFETENSORS_NAMES = {d.name: d.safetensors for d in ALL}  # "bfloat16" -> "BF16"
SAFETENSORS_DTYPES = {d.safetensors: d.name for d in ALL}  # "BF16" -> "bfloat16"
