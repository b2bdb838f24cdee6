import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import golden  # noqa: E402

# Before any rank process starts: the same CPU kernels (AVX2 paths of ATen,
# MKL and oneDNN) on every x86 machine, so exact results (the golden runs)
# do not depend on which machine the suite runs on.
golden.pin_cpu_numerics()
