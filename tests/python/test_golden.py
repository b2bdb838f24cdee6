"""Golden runs (issue 44): today's training reproduced bit for bit.

tests/python/data/golden_runs.json holds, for every configuration of
``golden.CONFIGS`` (TP2 x DP2, SP, int8 + ZeRO-1, PowerSGD, 1-bit with the
overlapped parameter gather, bf16 and fp16 with the loss scaler, MoE, CP,
every pipeline schedule, recompute, MegaFBD and the C++ trainer), each step's
loss and gradient norm as exact floats and every rank's CRC-32 of its
parameters and optimizer state after the last step. Moving an engine
algorithm from one implementation to another must reproduce them with
``==``. A change meant to alter numerics re-records them
(``python tests/python/golden.py``) and says so in its commit (the C++
trainer's record was re-recorded once, when C++ took torch.optim.AdamW's
arithmetic: it now equals the Python trainer's).
"""

import golden
import pytest

RECORD = golden.load()


def test_the_records_are_of_this_torch():
    import torch

    base = torch.__version__.split("+")[0]  # the CPU kernels do not depend on the CUDA build
    assert RECORD["torch"].split("+")[0] == base, (
        f"golden runs recorded with torch {RECORD['torch']}, running {torch.__version__}: "
        "install the pinned torch (make build) or re-record on the commit before your change")


def test_the_cpu_kernels_are_the_recorded_ones():
    import os

    assert {k: os.environ.get(k) for k in golden.CPU_NUMERICS} == RECORD["cpu_numerics"], (
        "the golden runs need conftest's pinned CPU kernels (golden.CPU_NUMERICS)")


def test_every_configuration_has_a_record():
    assert set(RECORD["runs"]) == set(golden.CONFIGS)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(golden.CONFIGS))
def test_golden_run_is_reproduced_exactly(tmp_path, name):
    got, want = golden.run(name, str(tmp_path / name)), RECORD["runs"][name]
    for key in want:
        assert got[key] == want[key], (
            f"{name}: {key} differs from the golden run\n  got  {got[key]}\n  want {want[key]}")


def test_the_cpp_trainer_records_what_the_python_trainer_records():
    """One engine: the C++ trainer (train_gpt) and pretrain_gpt.py at TP2 x
    DP2 give the same losses and gradient norms, bit for bit."""
    cpp, py = RECORD["runs"]["cpp-tp2-dp2"], RECORD["runs"]["tp2-dp2"]
    assert golden.CONFIGS["cpp-tp2-dp2"] == golden.CONFIGS["tp2-dp2"]
    assert cpp["loss"] == py["loss"] and cpp["grad_norm"] == py["grad_norm"], (cpp, py)
