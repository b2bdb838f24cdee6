"""Loss scaling for fp16 training (Megatron-LM's semantics and flag names).

fp16 has 5 exponent bits: small gradients underflow to zero. The loss is
multiplied by ``scale`` before backward, the fp32 main gradients are divided
by it before clipping and the step, and a step whose gradients hold an inf or
a NaN is skipped. :class:`DynamicGradScaler` then adapts the scale:

* an overflow costs one unit of *hysteresis*; when none is left the scale is
  multiplied by ``backoff_factor`` (0.5), never below ``min_scale``;
* after ``growth_interval`` (``--loss-scale-window``) steps in a row without
  overflow the scale is multiplied by ``growth_factor`` (2) and the
  hysteresis refills.

bf16 has fp32's exponent range and needs no scaling (Megatron uses none).

    scaler = DynamicGradScaler(initial_scale=2**32, min_scale=1.0,
                               growth_interval=1000, hysteresis=2)
    (loss * scaler.scale).backward(); ...; scaler.update(found_inf)

The scaler is the C++ engine's (``mapp::LossScaler`` in
``include/mapp/torch/ddp.h``, bound as ``megatronapp._C.LossScaler``, the one
C++ trainers get); these classes keep Megatron's names and checkpoint keys.
"""

from __future__ import annotations

from .. import _C

__all__ = ["ConstantGradScaler", "DynamicGradScaler"]


class ConstantGradScaler:
    """``--loss-scale S``: a fixed scale; overflowing steps are still skipped."""

    def __init__(self, scale: float):
        self._s = _C.LossScaler(float(scale))

    @property
    def scale(self) -> float:
        return self._s.scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._s.load(float(value), self._s.growth_tracker, self._s.hysteresis_tracker)

    @property
    def inv_scale(self) -> float:
        return self._s.inv_scale

    def update(self, found_inf: bool) -> None:
        self._s.update(bool(found_inf))

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler(ConstantGradScaler):
    """Megatron's dynamic scaler (see the module docstring)."""

    def __init__(self, initial_scale: float = 2.0**32, min_scale: float = 1.0,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 2):
        self._s = _C.LossScaler(float(initial_scale), float(min_scale), float(growth_factor),
                                float(backoff_factor), int(growth_interval), int(hysteresis))

    # The settings, read from the engine (one copy: setting them is not supported).
    min_scale = property(lambda self: self._s.min_scale)
    growth_factor = property(lambda self: self._s.growth_factor)
    backoff_factor = property(lambda self: self._s.backoff_factor)
    growth_interval = property(lambda self: self._s.growth_interval)
    hysteresis = property(lambda self: self._s.hysteresis)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self._s.growth_tracker,
                "hysteresis_tracker": self._s.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self._s.load(float(state["scale"]), int(state.get("growth_tracker", 0)),
                     int(state.get("hysteresis_tracker", self.hysteresis)))
