"""Byte ranges of a tensor slice, so that only the sliced bytes are read."""


def _normalize(index, shape):
    if not isinstance(index, tuple):
        index = (index,)
    if any(i is Ellipsis for i in index):
        pos = index.index(Ellipsis)
        fill = len(shape) - (len(index) - 1)
        index = index[:pos] + (slice(None),) * fill + index[pos + 1 :]
    if len(index) > len(shape):
        raise IndexError(f"too many indices ({len(index)}) for a tensor of {len(shape)} dimensions")
    index = index + (slice(None),) * (len(shape) - len(index))
    out = []
    for dim, (i, size) in enumerate(zip(index, shape)):
        if isinstance(i, slice):
            start, stop, step = i.indices(size)
            if step <= 0:
                raise ValueError("slice steps must be positive")
            out.append(range(start, stop, step))
        elif isinstance(i, list):
            if i:
                raise TypeError("Non empty lists are not implemented")
            out.append(range(0))
        else:
            try:
                k = int(i)
            except TypeError:
                raise TypeError(f"unsupported index {i!r}") from None
            if k < -size or k >= size:
                raise IndexError(f"Invalid index {k} for dimension {dim} of size {size}")
            out.append(k % size)
    return out


def plan_slice(shape, index, esize):
    """`(result_shape, [(byte_offset, nbytes)])` for `tensor[index]`, in row-major order.

    Contiguous runs are merged: slicing along the first dimension is one range; slicing the
    last dimension of a matrix is one range per row.
    """
    sel = _normalize(index, shape)
    out_shape = [len(s) for s in sel if isinstance(s, range)]
    strides = [0] * len(shape)
    acc = esize
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = acc
        acc *= shape[d]
    # The innermost dimensions taken whole (step 1, full range) form one contiguous block.
    k = len(shape)
    while k > 0 and isinstance(sel[k - 1], range) and sel[k - 1] == range(0, shape[k - 1]):
        k -= 1
    block = esize
    for d in range(k, len(shape)):
        block *= shape[d]
    ranges = []
    if any(isinstance(s, range) and len(s) == 0 for s in sel):
        return out_shape, []
    # Dimension k-1 (if any) with step 1 extends the block into a run.
    if k > 0 and isinstance(sel[k - 1], range) and sel[k - 1].step == 1:
        run_dim, outer = k - 1, sel[: k - 1]
    else:
        run_dim, outer = None, sel[:k]

    def rec(d, base):
        if d == len(outer):
            if run_dim is None:
                ranges.append((base, block))
            else:
                r = sel[run_dim]
                ranges.append((base + r.start * strides[run_dim], len(r) * block))
            return
        s = outer[d]
        if isinstance(s, range):
            for i in s:
                rec(d + 1, base + i * strides[d])
        else:
            rec(d + 1, base + s * strides[d])

    rec(0, 0)
    merged = []
    for off, n in ranges:
        if merged and merged[-1][0] + merged[-1][1] == off:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        else:
            merged.append((off, n))
    return out_shape, merged
