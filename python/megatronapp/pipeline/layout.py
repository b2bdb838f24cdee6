"""Which transformer layers each virtual pipeline stage holds."""

from __future__ import annotations

__all__ = ["layer_layout", "parse_layout", "virtual_stage"]


def virtual_stage(stage: int, chunk: int, p: int, placement: str = "loop") -> int:
    """The virtual stage of `chunk` on `stage` (what Schedule.vstage says):
    ``loop`` chunk * p + stage (Megatron's interleaved layout), ``wave`` (ZB-V)
    odd chunks run backwards, chunk * p + p-1-stage."""
    if placement == "wave" and chunk % 2 == 1:
        return chunk * p + p - 1 - stage
    return chunk * p + stage


def parse_layout(text: str) -> list[int]:
    """``"3,5,5,3"`` -> [3, 5, 5, 3] (layers per virtual stage, in order)."""
    try:
        out = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ValueError(f"pipeline layer layout '{text}': expected comma-separated layer "
                         "counts, one per virtual stage, e.g. '3,5,5,3'") from None
    return out


def layer_layout(num_layers: int, p: int, v: int = 1, *, first: int | None = None,
                 last: int | None = None, layout: list[int] | None = None) -> list[int]:
    """Layers per virtual stage (in model order; see :func:`virtual_stage`), summing to
    `num_layers`. Even by default; `first` / `last` fix the first and last
    virtual stage (Megatron's --decoder-first/last-pipeline-num-layers) and
    split the rest evenly; `layout` gives every count explicitly."""
    vs = p * v
    if layout is not None:
        if len(layout) != vs:
            raise ValueError(f"pipeline layer layout {layout} has {len(layout)} entries; expected "
                             f"one per virtual stage ({p} stages x {v} chunks = {vs})")
        if any(n < 1 for n in layout) or sum(layout) != num_layers:
            raise ValueError(f"pipeline layer layout {layout} must have positive counts summing to "
                             f"--num-layers {num_layers}")
        return list(layout)
    if num_layers < vs:
        raise ValueError(f"{num_layers} layers cannot fill {vs} virtual pipeline stages ({p} stages "
                         f"x {v} chunks): every virtual stage needs at least one layer; use more "
                         "layers or a smaller pipeline / virtual pipeline size")
    fixed = [x for x in (first, last) if x is not None]
    if any(x < 1 for x in fixed):
        raise ValueError("--decoder-first/last-pipeline-num-layers must be >= 1")
    if vs == 1:
        return [num_layers]
    rest_layers = num_layers - sum(fixed)
    rest_stages = vs - len(fixed)
    if rest_stages == 0:
        if rest_layers != 0:
            raise ValueError(f"first + last pipeline layers ({sum(fixed)}) must equal --num-layers "
                             f"{num_layers} with {vs} virtual stages")
        return [first, last]
    if rest_layers < rest_stages or rest_layers % rest_stages != 0:
        what = ("" if not fixed else f" after the first/last stages take {sum(fixed)}")
        raise ValueError(
            f"{rest_layers} layers{what} do not divide evenly over {rest_stages} virtual pipeline "
            f"stages; pass --decoder-first-pipeline-num-layers / "
            f"--decoder-last-pipeline-num-layers or --pipeline-layer-layout (e.g. "
            f"'{_example(num_layers, vs)}')")
    even = rest_layers // rest_stages
    out = [even] * vs
    if first is not None:
        out[0] = first
    if last is not None:
        out[-1] = last
    return out


def _example(n: int, k: int) -> str:
    base, extra = divmod(n, k)
    return ",".join(str(base + (1 if i < extra else 0)) for i in range(k)) if base else "..."
