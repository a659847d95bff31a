"""Reading a framework's own batch object, duck-typed, for the dump adapters (`read_batch`).

Each framework module's adapter knows its object's field names; these helpers read a field by
name from a mapping (a dict, verl's `TensorDict`, SkyRL's `TensorBatch`, NeMo-RL's
`BatchedDataDict`) or an attribute (OpenRLHF's `Experience`), without importing the
framework, and word the error when a required one is missing.

>>> field({"a": 1}, "a"), field({"a": 1}, "b")
(1, None)
>>> need({"a": 1}, "b", "TRL's loss inputs", "TRL computes it only with vLLM")
Traceback (most recent call last):
...
iscore.errors.DumpError: TRL's loss inputs have no 'b' (found 'a'): TRL computes it only with vLLM
"""

from __future__ import annotations

from typing import Any

from iscore.errors import DumpError, quote


def field(obj: Any, key: str) -> Any:
    """`obj[key]` for a mapping-like object, else `obj.key`; None when absent."""
    if hasattr(obj, "keys") and hasattr(obj, "get"):
        return obj.get(key, None)
    return getattr(obj, key, None)


def need(obj: Any, key: str, what: str, hint: str) -> Any:
    """`field(obj, key)`, which must not be None.

    Args:
        what: the object in words, plural verb form ("verl's batch tensors").
        hint: where the framework computes the field, or how to turn it on.

    Raises:
        DumpError: the field is missing or None.
    """
    value = field(obj, key)
    if value is None:
        raise DumpError(f"{what} have no {quote(key)}{_found(obj)}: {hint}")
    return value


def same_tensor(a: Any, b: Any) -> bool:
    """Whether two tensors share their memory and shape (one is the other under two names)."""
    ptr_a, ptr_b = getattr(a, "data_ptr", None), getattr(b, "data_ptr", None)
    if ptr_a is None or ptr_b is None:
        return a is b
    return ptr_a() == ptr_b() and tuple(a.shape) == tuple(b.shape)


def _found(obj: Any) -> str:
    if not hasattr(obj, "keys"):
        return ""
    keys = sorted(str(k) for k in obj.keys())  # noqa: SIM118 - a TensorDict iterates otherwise
    shown = ", ".join(quote(k) for k in keys[:12]) + (", ..." if len(keys) > 12 else "")
    return f" (found {shown})" if keys else " (it is empty)"
