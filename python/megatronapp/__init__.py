"""MegatronApp: a distributed training runtime for large language models.

    import megatronapp as mapp
    torch.distributed.init_process_group("gloo")      # or "nccl"
    mapp.initialize_model_parallel(tensor_model_parallel_size=2)
    layer = mapp.tensor_parallel.ColumnParallelLinear(1024, 4096)

Importing the package loads the native library, which registers the
`torch.ops.mapp.*` operators.
"""

import os as _os

import torch as _torch  # noqa: F401  (loads libtorch before our library)

from . import (  # noqa: E402,I001
    _C,
    comm,
    data_parallel,
    memory,
    models,
    optimizer,
    parallel_state,
    tensor_parallel,
    training,  # noqa: E402
)
from ._C import RankGrid
from .parallel_state import (
    ParallelState,
    destroy_model_parallel,
    get_parallel_state,
    initialize_model_parallel,
    model_parallel_is_initialized,
)

__version__ = "0.1.0"

#: Directory to add to CMAKE_PREFIX_PATH so that C++ trainers can
#: `find_package(megatronapp CONFIG)` against this installation.
cmake_prefix_path = _os.path.join(_os.path.dirname(_C.__file__), "lib", "cmake")

__all__ = [
    "ParallelState",
    "RankGrid",
    "cmake_prefix_path",
    "destroy_model_parallel",
    "get_parallel_state",
    "initialize_model_parallel",
    "memory",
    "model_parallel_is_initialized",
    "comm",
    "data_parallel",
    "memory",
    "models",
    "optimizer",
    "parallel_state",
    "tensor_parallel",
    "training",
]
