"""Model TFLOP/s per rank and MFU, as Megatron-LM logs them.

One iteration's model FLOPs are ``3 x global batch x seq_length x
GPTConfig.flops_per_token()`` (forward, and backward at twice the forward: the
gradients of the inputs and of the weights), without recomputation. Per rank,
``TFLOP/s = FLOPs / (iteration seconds x world size) / 1e12``, and
``MFU = TFLOP/s / --peak-tflops``. ``--peak-tflops`` defaults to the device's
dense BF16 peak (FP8's once FP8 GEMMs are on); on a CPU there is none, so
MFU is left out unless the flag gives one.
"""

from __future__ import annotations

__all__ = ["PEAK_TFLOPS", "Throughput", "device_peak_tflops", "iteration_flops"]

#: dense (no sparsity) peak TFLOP/s per GPU: (BF16, FP8), from the vendors'
#: data sheets; the first name that appears in torch's device name wins
PEAK_TFLOPS = (
    ("H100 PCIe", (756.0, 1513.0)),
    ("H100 NVL", (835.0, 1671.0)),
    ("H100", (989.0, 1979.0)),  # SXM
    ("H200", (989.0, 1979.0)),
    ("GB200", (2500.0, 5000.0)),
    ("B200", (2250.0, 4500.0)),
    ("A100", (312.0, None)),
    ("L40S", (362.0, 733.0)),
)


def device_peak_tflops(device, fp8: bool = False) -> float | None:
    """The dense peak of ``device`` (a torch.device) in TFLOP/s, or None
    (a CPU, or a GPU not in :data:`PEAK_TFLOPS`: give --peak-tflops)."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    for key, (bf16, f8) in PEAK_TFLOPS:
        if key in name:
            return f8 if fp8 else bf16
    return None


def iteration_flops(model_config, global_batch_size: int) -> float | None:
    """Model FLOPs of one training iteration (forward and backward); None for
    a model that does not count its FLOPs (the vision tasks)."""
    per_token = getattr(model_config, "flops_per_token", None)
    if per_token is None:
        return None
    return 3.0 * global_batch_size * model_config.seq_length * per_token()


class Throughput:
    """TFLOP/s per rank and MFU of a run: ``of(seconds, iterations)``."""

    def __init__(self, model_config, global_batch_size: int, world: int, device,
                 peak_tflops: float | None = None):
        self.flops = iteration_flops(model_config, global_batch_size)
        self.world = world
        self.peak = peak_tflops or device_peak_tflops(device)

    def of(self, seconds: float, iterations: int = 1) -> dict:
        """{"tflops_per_rank", "mfu"} of ``iterations`` taking ``seconds`` (the
        keys that are known: none without a FLOP count, no MFU without a peak)."""
        if self.flops is None or seconds <= 0:
            return {}
        tflops = self.flops * iterations / seconds / self.world / 1e12
        out = {"tflops_per_rank": tflops}
        if self.peak:
            out["mfu"] = tflops / self.peak
        return out
