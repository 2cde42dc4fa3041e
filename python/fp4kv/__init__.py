"""fp4kv: an NVFP4 KV cache for LLM attention (C++17/CUDA), from Python.

The classes and functions are those of the C++ API (include/fp4kv/), named in
snake_case; docs/python.md describes them and the rules for tensors (DLPack),
streams and lifetimes.
"""

from ._core import *  # noqa: F401,F403
from ._core import (  # noqa: F401  (re-exported explicitly for type checkers)
    Error,
    InvalidArgumentError,
    NotFoundError,
    FailedPreconditionError,
    ResourceExhaustedError,
    OutOfRangeError,
    UnimplementedError,
    DataLossError,
    InternalError,
)

__version__ = "0.1.0"
