"""`python -m megatronapp` / `megatronapp-info`: build and environment report."""

import megatronapp as mapp
import torch
from megatronapp import _C


def main() -> None:
    print(f"megatronapp {mapp.__version__} (built against torch {mapp.__torch_version__}, "
          f"running torch {torch.__version__}, "
          f"CUDA kernels built: {_C.built_with_cuda()}, CUDA available: "
          f"{torch.cuda.is_available()})")
    print("operators:", ", ".join(_C.registered_ops()))
    print("cmake prefix:", mapp.cmake_prefix_path)
    print("tunables:")
    for name, value, default, meaning in _C.tunables():
        print(f"  {name}={value} (default {default}): {meaning}")


if __name__ == "__main__":
    main()
