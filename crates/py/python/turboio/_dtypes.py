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

# Sub-byte dtypes that torch stores packed along the last dimension: values per byte.
_PACKED = {"F4": 2}


def torch_dtype(name):
    """The torch dtype of a safetensors dtype, or None when torch has none (bytes then)."""
    import torch

    attr = _TORCH_NAMES.get(name)
    return getattr(torch, attr, None) if attr else None


def torch_dtype_for(name, shape):
    """The torch dtype a tensor of this safetensors dtype and shape comes out as, or None when it
    comes out as flat uint8 bytes: dtypes torch has not, and packed dtypes (F4, two values per
    byte of `float4_e2m1fn_x2` along the last dimension) whose last dimension does not pack into
    whole bytes (a scalar, or an odd last dimension such as [2, 3])."""
    per_byte = _PACKED.get(name)
    if per_byte is not None and (not shape or shape[-1] % per_byte != 0):
        return None
    return torch_dtype(name)


def torch_shape(name, shape):
    """The shape of the torch tensor for a safetensors dtype and shape: the packed shape (last
    dimension divided by the values per byte) for packed dtypes that pack, the flat byte count
    for tensors that come out as bytes, else the shape itself."""
    per_byte = _PACKED.get(name)
    if per_byte is not None and shape and shape[-1] % per_byte == 0:
        return list(shape[:-1]) + [shape[-1] // per_byte]
    if name in _TORCH_NAMES and torch_dtype_for(name, shape) is not None:
        return list(shape)
    bits = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}.get(name)
    if bits is None:
        return list(shape)
    n = 1
    for d in shape:
        n *= d
    return [(n * bits + 7) // 8]


def safetensors_name(dtype):
    """The safetensors dtype string of a torch dtype; ValueError if it has none."""
    import torch

    for st, attr in _TORCH_NAMES.items():
        if getattr(torch, attr, None) == dtype:
            return st
    raise ValueError(f"dtype {dtype} cannot be stored in a safetensors file")


# The floating dtypes a load converts between (turboio_format::cast; torch's `.to()` bit for bit).
CASTABLE = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def load_dtype(dtype):
    """The safetensors name of a `dtype=` load argument (a torch dtype, or a name such as
    "bfloat16" or "BF16"); None for None. ValueError unless it is a floating dtype a load can
    convert to."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        by_torch = {v: k for k, v in _TORCH_NAMES.items()}
        name = by_torch.get(name, name.upper())
    else:
        name = safetensors_name(dtype)
    if name not in CASTABLE:
        raise ValueError(
            f"cannot convert tensors to {dtype} on load: dtype must be a floating dtype "
            "(float64, float32, float16, bfloat16, float8_e4m3fn or float8_e5m2)"
        )
    return name


def convert(tensors, name):
    """`{k: t}` with every tensor of a convertible floating dtype converted to the dtype named
    `name` (torch's `.to()`), the others as they are: what a converting load does in Rust, for
    the paths that build tensors in Python (`.pt` files, torch.load)."""
    if name is None:
        return tensors
    target = torch_dtype(name)
    out = {}
    for k, t in tensors.items():
        try:
            own = safetensors_name(t.dtype)
        except (ValueError, AttributeError):
            own = None
        out[k] = t.to(target) if own in CASTABLE and own != name else t
    return out
