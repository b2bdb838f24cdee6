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
"""

from __future__ import annotations

__all__ = ["ConstantGradScaler", "DynamicGradScaler"]


class ConstantGradScaler:
    """``--loss-scale S``: a fixed scale; overflowing steps are still skipped."""

    def __init__(self, scale: float):
        if not scale > 0:
            raise ValueError(f"loss scale must be positive, got {scale}")
        self.scale = float(scale)

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler(ConstantGradScaler):
    """Megatron's dynamic scaler (see the module docstring)."""

    def __init__(self, initial_scale: float = 2.0**32, min_scale: float = 1.0,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 2):
        super().__init__(initial_scale)
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"min loss scale must be in (0, initial scale {initial_scale}], "
                             f"got {min_scale}")
        if growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError("growth factor must exceed 1 and backoff factor lie in (0, 1)")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(f"loss-scale window ({growth_interval}) and hysteresis "
                             f"({hysteresis}) must be >= 1")
        self.min_scale = float(min_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis = int(growth_interval), int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = int(state.get("growth_tracker", 0))
        self._hysteresis_tracker = int(state.get("hysteresis_tracker", self.hysteresis))
