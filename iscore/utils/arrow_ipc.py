"""An Arrow array as bytes and back: an IPC stream of one column, its type kept, nothing pickled
(what a results store keeps of a part's sequence ids)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def to_ipc(array: pa.Array) -> np.ndarray:
    """uint8 [bytes]: `array` as an Arrow IPC stream (its type kept; nothing pickled)."""
    sink = pa.BufferOutputStream()
    batch = pa.record_batch([array], names=["x"])
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return np.frombuffer(sink.getvalue(), dtype=np.uint8)


def from_ipc(data: np.ndarray) -> pa.Array:
    """The array `to_ipc` wrote, validated.

    Raises:
        ValueError: the bytes are not one such stream.
    """
    try:
        table = pa.ipc.open_stream(pa.py_buffer(data.tobytes())).read_all()
        table.validate(full=True)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"ids: not an Arrow stream: {e}") from e
    if table.num_columns != 1:
        raise ValueError("ids: expected one column")
    return table.column(0).combine_chunks()
