"""The table of element types a shard can hold: torch dtype <-> name <-> HDF5 storage type.

Types numpy knows are stored as themselves, so h5py reads them as numbers. The others (bfloat16,
the float8 family, complex32) are stored as unsigned integers of the same width, and the
``torch_dtype`` attribute says how to view them.
"""

from __future__ import annotations

import numpy as np
import torch

# name -> (torch dtype, numpy storage dtype)
_TABLE: dict[str, tuple[torch.dtype, np.dtype]] = {}


def _add(name: str, storage: str) -> None:
    dt = getattr(torch, name, None)
    if isinstance(dt, torch.dtype):
        _TABLE[name] = (dt, np.dtype(storage))


for _n, _s in [
    ("float64", "<f8"), ("float32", "<f4"), ("float16", "<f2"), ("bfloat16", "<u2"),
    ("complex128", "<c16"), ("complex64", "<c8"), ("complex32", "<u4"),
    ("int64", "<i8"), ("int32", "<i4"), ("int16", "<i2"), ("int8", "i1"),
    ("uint64", "<u8"), ("uint32", "<u4"), ("uint16", "<u2"), ("uint8", "u1"), ("bool", "?"),
    ("float8_e4m3fn", "u1"), ("float8_e5m2", "u1"), ("float8_e4m3fnuz", "u1"),
    ("float8_e5m2fnuz", "u1"), ("float8_e8m0fnu", "u1"),
]:
    _add(_n, _s)

_BY_DTYPE = {dt: name for name, (dt, _) in _TABLE.items()}


def name_of(dtype: torch.dtype) -> str:
    """The stable name of a torch dtype, or ValueError if shards cannot hold it."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored by mpickpt") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a stored name; ValueError for a name not in the table."""
    try:
        return _TABLE[name][0]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}") from None


def storage_dtype(name: str) -> np.dtype:
    """The numpy type the HDF5 dataset of this dtype is declared with."""
    return _TABLE[name][1]


def itemsize(name: str) -> int:
    return _TABLE[name][1].itemsize


def names() -> list[str]:
    return list(_TABLE)
