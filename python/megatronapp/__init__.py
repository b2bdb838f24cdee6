"""MegatronApp: a distributed training runtime for large language models.

    import megatronapp as mapp
    torch.distributed.init_process_group("mapp")      # or "gloo", "nccl", "cpu:mapp,cuda:nccl"
    mapp.initialize_model_parallel(tensor_model_parallel_size=2)
    layer = mapp.tensor_parallel.ColumnParallelLinear(1024, 4096)

Importing the package loads the native library, which registers the
`torch.ops.mapp.*` operators.
"""

import os as _os

import torch as _torch  # noqa: F401  (loads libtorch before our library)

try:  # written at build time (CMake): the torch this build was compiled against
    from ._build_info import torch_version as __torch_version__
except ImportError:  # a source tree that was never built: _C will say so
    __torch_version__ = None
if __torch_version__ is not None and \
        __torch_version__.split("+")[0] != _torch.__version__.split("+")[0]:
    raise ImportError(
        f"megatronapp was built against torch {__torch_version__} but torch "
        f"{_torch.__version__} is installed; its C++ extension needs the same torch (the ABI "
        f"changes between releases): pip install torch=={__torch_version__.split('+')[0]}, or "
        "rebuild megatronapp against this torch (pip install --no-build-isolation .)")

from . import (  # noqa: E402,I001
    _C,
    distributed,
    memory,
    models,
    moe,  # registers the MoE layer with the GPT model (GPTConfig(num_experts=...))
    optimizer,
    parallel_state,
    resilience,
    tensor_parallel,
    tools,
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

distributed.backend.register()  # torch.distributed.init_process_group("mapp")

try:  # written by setuptools-scm at build time from the git tag (vX.Y.Z)
    from ._version import version as __version__
except ImportError:  # a source tree that was never built
    __version__ = "0.0.0+unknown"

#: Directory to add to CMAKE_PREFIX_PATH so that C++ trainers can
#: `find_package(megatronapp CONFIG)` against this installation.
cmake_prefix_path = _os.path.join(_os.path.dirname(_C.__file__), "lib", "cmake")

__all__ = [
    "__torch_version__",
    "__version__",
    "ParallelState",
    "RankGrid",
    "cmake_prefix_path",
    "destroy_model_parallel",
    "get_parallel_state",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "distributed",
    "memory",
    "models",
    "moe",
    "optimizer",
    "parallel_state",
    "resilience",
    "tensor_parallel",
    "tools",
    "training",
]


def __getattr__(name: str):
    """megatronapp.<old module> (moved in the 2026-12 regroup): the new one, with a
    DeprecationWarning (see megatronapp._moved)."""
    if not name.startswith("_"):
        from ._moved import MOVED, alias

        if f"{__name__}.{name}" in MOVED:
            return alias(f"{__name__}.{name}", stacklevel=3)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
