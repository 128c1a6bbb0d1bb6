"""Dtype names: safetensors strings <-> torch dtypes."""

_TORCH_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "C64": "complex64",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F4": "float4_e2m1fn_x2",
    # F6_E2M3 and F6_E3M2 have no torch dtype: they come out as uint8 bytes.
}


def torch_dtype(name):
    """The torch dtype of a safetensors dtype, or None when torch has none (bytes then)."""
    import torch

    attr = _TORCH_NAMES.get(name)
    return getattr(torch, attr, None) if attr else None


def safetensors_name(dtype):
    """The safetensors dtype string of a torch dtype; ValueError if it has none."""
    import torch

    for st, attr in _TORCH_NAMES.items():
        if getattr(torch, attr, None) == dtype:
            return st
    raise ValueError(f"dtype {dtype} cannot be stored in a safetensors file")
