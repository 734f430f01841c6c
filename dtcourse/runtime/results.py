"""How a rank's result travels to the parent: a pickle with its CPU tensors out of band.

A result message is a pickle (protocol 5) whose CPU tensors travel out of band: the pickle holds
only their dtype and shape, and their bytes follow it raw, written straight from the tensor's
memory (``encode`` returns the parts to write) and read straight into one buffer allocated to the
message's size, which the tensors ``decode`` returns then share. So a 256 MB result is copied once
on each side of the pipe, not re-encoded by ``torch.save`` and copied again on every append as
plain pickling into a growing ``bytes`` did. Layout::

    total size (8 bytes) | part count n (8) | n part sizes (8 each) | pickle | buffer 1 | ... | buffer n-1
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

__all__ = ["encode", "decode"]


def _tensor_from_bytes(data: pickle.PickleBuffer | memoryview, dtype: torch.dtype, shape: tuple,
                       requires_grad: bool) -> torch.Tensor:
    raw = memoryview(data).cast("B")
    t = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
    return t.view(dtype).reshape(shape).requires_grad_(requires_grad)


def _reduce_tensor(t: torch.Tensor) -> tuple:
    """Pickle a plain CPU tensor as its dtype, shape and one out-of-band buffer of its bytes."""
    if t.device.type != "cpu" or t.is_sparse or t.is_quantized or t.is_nested:
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)                  # torch's own way
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)        # (numel * element_size,)
    return _tensor_from_bytes, (pickle.PickleBuffer(flat.numpy()), t.dtype, tuple(t.shape), t.requires_grad)


class _ResultPickler(pickle.Pickler):
    dispatch_table = {torch.Tensor: _reduce_tensor}


def encode(value: Any) -> list[memoryview]:
    """A message as the parts to write: a header of lengths, the pickle, then each raw buffer."""
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    _ResultPickler(stream, protocol=5, buffer_callback=buffers.append).dump(value)
    parts = [stream.getbuffer(), *(b.raw() for b in buffers)]
    header = b"".join(n.to_bytes(8, "little") for n in (len(parts), *(p.nbytes for p in parts)))
    total = 8 + len(header) + sum(p.nbytes for p in parts)
    return [memoryview(total.to_bytes(8, "little") + header), *parts]


def decode(message: bytearray) -> Any:
    """The value ``encode`` wrote; its tensors share ``message``'s memory (no copy)."""
    view = memoryview(message)
    count = int.from_bytes(view[8:16], "little")
    sizes = [int.from_bytes(view[16 + 8 * i:24 + 8 * i], "little") for i in range(count)]
    offset, parts = 16 + 8 * count, []
    for size in sizes:
        parts.append(view[offset:offset + size])
        offset += size
    return pickle.loads(parts[0], buffers=parts[1:])
