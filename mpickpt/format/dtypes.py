"""The table of element types a shard can hold: torch dtype <-> name <-> HDF5 storage type.

Types numpy knows are stored as themselves, so h5py reads them as numbers. The others (bfloat16,
the float8 family, complex32) are stored as unsigned integers of the same width, and the
``torch_dtype`` attribute says how to view them. The names, sizes and storage types are
:data:`mpickpt.format.records.DTYPES` (torch-free, for the operator's tools); this module adds
torch.
"""

from __future__ import annotations

import numpy as np
import torch

from .records import DTYPES

# name -> (torch dtype, numpy storage dtype)
_TABLE: dict[str, tuple[torch.dtype, np.dtype]] = {}


def _add(name: str, storage: str) -> None:
    dt = getattr(torch, name, None)
    if isinstance(dt, torch.dtype):
        _TABLE[name] = (dt, np.dtype(storage))


for _n, (_, _s) in DTYPES.items():
    _add(_n, _s)

_BY_DTYPE = {dt: name for name, (dt, _) in _TABLE.items()}


def supported() -> frozenset[torch.dtype]:
    """The torch dtypes a shard can hold."""
    return frozenset(_BY_DTYPE)


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
