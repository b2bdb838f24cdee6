"""Data-parallel engine: bucketed, overlapped, optionally compressed gradient sync.

    model = mapp.data_parallel.DistributedDataParallel(model, compression="int8")
    loss = model(x, y).mean(); loss.backward()   # grads averaged when backward returns
    optimizer.step()

How it works (the engine is C++: ``mapp::GradReducer`` in ``src/torch/ddp.cc``,
bound as ``megatronapp._C.GradReducer``; C++ trainers use the same through
``mapp::DistributedDataParallel``; this module is its front-end):

* Gradients live in contiguous per-bucket buffers (one dtype per bucket,
  about `bucket_size_mb` each, parameters in reverse registration order so the
  first buckets fill first during backward); each ``param.grad`` is a view
  into its bucket.
* A C++ hook on each parameter's gradient accumulator (added next to, never
  replacing, a user's own hooks; no Python runs in it) marks parameters
  ready; when a bucket is complete its reduction is submitted to the group's
  communication thread while backward goes on. Buckets are submitted
  strictly in order, so every rank issues the same sequence of collectives
  even when readiness order differs.
* **finish_grad_sync() runs automatically at the end of backward** (queued on
  the autograd engine by the first hook of that backward): it submits the
  buckets not yet submitted (e.g. those holding unused parameters, whose
  gradients are then zeros or whatever was accumulated) and waits for all of
  them, so ``loss.backward()`` returns with averaged gradients. Calling it
  again is a no-op.
* Gradients are averaged (SUM, then divide: Gloo's AVG has a known bug).
* **Mixed precision** (``grad_reduce_in_fp32=True``, Megatron's DDP option):
  for parameters in bf16/fp16 the buckets hold float32 gradients; each such
  parameter gets ``param.main_grad``, a float32 view into its bucket, and the
  readiness hook adds ``param.grad`` into it and frees ``param.grad``
  (microbatches accumulate in float32, and the reduction and any codec run on
  float32). Such buffers are zeroed by :meth:`zero_grad_buffer` (the
  optimizers' ``zero_grad`` calls it), not by forward.
* ``no_sync()`` skips synchronization (gradient accumulation), like torch DDP.
* Under pipeline parallelism (``megatronapp.pipeline.forward_backward``) the
  executor uses the module as a :class:`~megatronapp.pipeline.GradSync`: it
  enables synchronization only for the last backward of each chunk (so a
  chunk's buckets start reducing as soon as its last weight gradient is done),
  inside ``deferred_grad_sync()`` (no finish at the end of each backward), and
  calls ``finish_grad_sync()`` at the end of the step.
* Checkpoints read and restore the codec state (error-feedback residuals,
  PowerSGD's Q) and the step counter through ``codec_state_dict()`` /
  ``load_codec_state_dict()``.
* With a :class:`~megatronapp.optimizer.DistributedOptimizer` (ZeRO-1) the
  buckets are reduce-scattered instead: each rank receives the averaged
  float32 gradients of the shard it owns, and parameters are views into
  per-bucket parameter buffers that the optimizer all-gathers after its step.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

import torch
from torch import nn

from .. import _C, _collectives
from ..parallel_state import ParallelState, get_parallel_state
from ..tensor_parallel.utils import is_tensor_parallel
from .comm import parse_compression

__all__ = ["DistributedDataParallel"]


class Bucket:
    """One of the engine's gradient buckets (``_C.GradBucket``: ``index``,
    ``params``, ``offsets``, ``numel``, ``dtype``, ``grad_data`` (float32 when
    the parameters keep main gradients), ``param_data`` and ``shard``
    (ZeRO-1), ``layout``, ``state``, ``exact``, ``expert``, ``raw_bytes`` /
    ``sent_bytes`` of its last reduction, ``gather_in_flight``) with its
    reduction ``group`` (a ProcessGroup: the data group, or the expert-data
    group for MoE experts)."""

    __slots__ = ("_b", "_reducer", "group")

    def __init__(self, b, reducer, group):
        self._b, self._reducer, self.group = b, reducer, group

    def __getattr__(self, name):
        return getattr(self._b, name)

    def chunk_range(self, sharded: bool) -> tuple:
        """[lo, hi) of the bucket this rank updates: under ZeRO-1
        (`sharded`) chunk r of the padded buffer for rank r of the bucket's
        group, else all of it."""
        return self._reducer.chunk_range(self._b.index, sharded)


class DistributedDataParallel(nn.Module):
    """Wraps `module`; see the module docstring.

    Args:
        module: the model (its parameters must be identical in number, shape
            and dtype on every rank of the group: checked at construction).
        process_group: defaults to the data-parallel group of the grid (data x
            context with context parallelism; the world when model
            parallelism is not initialized).
        bucket_size_mb: target bucket size.
        compression: None, a spec string (``"int8"``, ``"powersgd:4"``, ...) or
            a :class:`~megatronapp.distributed.comm.Compression` with a warm-up.
        overlap_grad_reduce: submit bucket reductions during backward (True)
            or all at the end of backward (False).
        gradient_accumulation_fusion: the model's linear layers add each weight
            gradient into its bucket in the GEMM itself (beta = 1) instead of
            through a temporary that autograd adds (Megatron-LM's
            ``gradient_accumulation_fusion``; True). Where ``.grad`` is the
            bucket's view (not under ``grad_reduce_in_fp32`` main gradients).
        broadcast_parameters: copy rank 0's parameters to every rank first.
        grad_reduce_in_fp32: accumulate and reduce the gradients of non-fp32
            parameters in float32 ``param.main_grad`` buffers.
    """

    def __init__(self, module: nn.Module, *, process_group: dist.ProcessGroup | None = None,
                 bucket_size_mb: float = 25, compression=None, overlap_grad_reduce: bool = True,
                 broadcast_parameters: bool = True, grad_reduce_in_fp32: bool = False,
                 parallel_state: ParallelState | None = None,
                 gradient_accumulation_fusion: bool = True):
        super().__init__()
        self.module = module
        if process_group is None:
            # The weights' replicas: the data-parallel ranks, times the
            # context-parallel ones when sequences are split.
            try:
                st = parallel_state or get_parallel_state()
                process_group = st.data_context_group or st.data_group
            except RuntimeError:
                process_group = dist.group.WORLD
        self.group = process_group
        self.world = process_group.size()
        self.compression = parse_compression(compression)
        try:
            tp_size = (parallel_state or get_parallel_state()).tp_size
        except RuntimeError:
            tp_size = 1
        # Under tensor parallelism, parameters replicated over the tensor group
        # (LayerNorm, row-parallel biases, ...) are reduced exactly: a lossy
        # codec would quantize them differently on each tensor rank (their
        # buckets hold different shards) and the replicas would drift apart.
        self._exact_replicated = tp_size > 1
        # Experts (megatronapp.moe) differ across the expert-parallel ranks of
        # the data group: reduced over the expert-data-parallel group.
        self.expert_group, self.expert_scale = self.group, 1.0
        if any(getattr(p, "expert_parallel", False) for p in module.parameters()):
            st = parallel_state or get_parallel_state()
            if process_group is not (st.data_context_group or st.data_group):
                raise ValueError("DistributedDataParallel with MoE experts reduces over the "
                                 "grid's data (x context) and expert-data groups; do not pass "
                                 "process_group")
            self.expert_group = st.expert_data_group_or_data()
            self.expert_scale = st.expert_grad_scale()
        self.overlap_grad_reduce = overlap_grad_reduce
        self.grad_reduce_in_fp32 = grad_reduce_in_fp32
        self.bucket_size = int(bucket_size_mb * 1024 * 1024)
        if self.bucket_size <= 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
        self._check_replicas_match()
        if broadcast_parameters and self.world > 1:
            src = dist.get_global_rank(self.group, 0)
            esrc = dist.get_global_rank(self.expert_group, 0)
            with torch.no_grad():
                for p in module.parameters():
                    if getattr(p, "expert_parallel", False):
                        if self.expert_group.size() > 1:
                            dist.broadcast(p.data, src=esrc, group=self.expert_group)
                    else:
                        dist.broadcast(p.data, src=src, group=self.group)
        params = [p for p in module.parameters() if p.requires_grad]
        options = _C.ReducerOptions()
        options.bucket_bytes = self.bucket_size
        options.compression = self.compression.spec if self.compression else "none"
        options.compression_start_iter = self.compression.start_iter if self.compression else 0
        options.overlap_grad_reduce = overlap_grad_reduce
        options.gradient_accumulation_fusion = gradient_accumulation_fusion
        options.grad_reduce_in_fp32 = grad_reduce_in_fp32
        options.group = self.group.group_name
        options.expert_group = self.expert_group.group_name
        options.expert_scale = self.expert_scale
        self._reducer = _C.GradReducer(
            params,
            exact=[self._exact_replicated and not is_tensor_parallel(p) for p in params],
            expert=[bool(getattr(p, "expert_parallel", False)) for p in params],
            own_bucket=[bool(getattr(p, "shared_embedding", False)) for p in params],
            options=options)
        self._wrap_buckets()
        self._gather_hooks = None  # installed by the first start_param_sync()

    # ---- construction --------------------------------------------------------
    def _check_replicas_match(self) -> None:
        # Expert names carry global expert ids, which differ across the
        # expert-parallel ranks: compared by shape only.
        desc = repr([("expert" if getattr(p, "expert_parallel", False) else n, tuple(p.shape),
                      str(p.dtype), p.requires_grad)
                     for n, p in self.module.named_parameters()])
        mine = torch.tensor([_C.crc32(desc.encode())], dtype=torch.int64)
        if self.world == 1:
            return
        device = next(self.module.parameters()).device
        allh = _collectives.all_gather(mine.to(device), 0, self.group).cpu()
        if not bool((allh == allh[0]).all()):
            ranks = [dist.get_global_rank(self.group, i) for i in range(self.world)]
            groups = {}
            for r, h in zip(ranks, allh.tolist(), strict=True):
                groups.setdefault(h, []).append(r)
            raise ValueError(
                "DistributedDataParallel: the model differs across data-parallel ranks "
                f"(parameter names/shapes/dtypes hash to {len(groups)} different values: "
                f"{list(groups.values())}); every rank of the group must build the same model")

    def _wrap_buckets(self) -> None:
        """The engine's buckets with their groups; ``param.main_grad`` set to
        the float32 views of buckets that keep main gradients."""
        self.buckets = [Bucket(b, self._reducer, self.expert_group if b.expert else self.group)
                        for b in self._reducer.buckets]
        for b in self.buckets:
            for p, main in zip(b.params, b.main_grads, strict=False):
                p.main_grad = main

    @property
    def uses_distributed_optimizer(self) -> bool:
        """True once a ZeRO-1 optimizer switched the buckets to reduce-scatter."""
        return self._reducer.uses_distributed_optimizer

    @property
    def synchronized_steps(self) -> int:
        """Backward passes whose gradients were synchronized (the codec warm-up
        of ``Compression(start_iter=...)`` counts these)."""
        return self._reducer.synchronized_steps

    def enable_distributed_optimizer(self) -> None:
        """Switches to ZeRO-1 mode: parameters become views into contiguous
        per-bucket buffers and reductions become reduce-scatters. Called by
        DistributedOptimizer before the first backward.

        Buffers are padded to a multiple of world x the codec's block, so the
        shard each rank owns is the same for every codec (warm-up included)."""
        if self.uses_distributed_optimizer:
            return
        self._reducer.enable_distributed_optimizer()
        self._wrap_buckets()  # new (padded) main-gradient views

    def shard_pieces(self, sharded: bool) -> list:
        """What an optimizer with fp32 main parameters updates on this rank
        (the engine's layout, the C++ DistributedOptimizer's too):
        ``(bucket, param, lo, hi, shard_lo, param_lo)`` per piece, [lo, hi) in
        bucket coordinates, `shard_lo` within this rank's chunk, `param_lo`
        within the flat parameter. Under ZeRO-1 (`sharded`) each parameter's
        part of this rank's chunk of its bucket; otherwise every parameter whole."""
        params = [b.params for b in self.buckets]
        return [(self.buckets[bi], params[bi][slot], lo, hi, shard_lo, param_lo)
                for bi, slot, lo, hi, shard_lo, param_lo in self._reducer.pieces(sharded)]

    # ---- ZeRO-1: the parameter all-gather, overlapped with the next forward --------
    def start_param_sync(self, force_sync: bool = False) -> None:
        """Submits every bucket's parameter all-gather (ZeRO-1: each rank's
        updated chunk of ``param_data`` to all) on the bucket group's
        communication thread and returns at once. A forward pre-hook of each
        module waits for the buckets of its own parameters just before it
        runs, so the gathers overlap the next forward (Megatron-LM's
        ``--overlap-param-gather``); :meth:`finish_param_sync` waits for all.
        With ``force_sync`` (Megatron's name) the gathers run now and return
        done."""
        if not self.uses_distributed_optimizer:
            raise RuntimeError("start_param_sync needs ZeRO-1 buckets (DistributedOptimizer)")
        if force_sync:
            self._reducer.all_gather_params()
            return
        if self._gather_hooks is None:
            self._install_gather_hooks()
        self._reducer.start_param_sync()

    def finish_param_sync(self, buckets=None) -> None:
        """Waits for the parameter all-gathers in flight (of `buckets`, default
        all). Anything that reads or writes the parameters outside a forward
        (checkpoints, the optimizer, evaluation) calls it first; cheap when
        nothing is in flight."""
        if self._reducer.gathers_pending:
            self._reducer.finish_param_sync(
                None if buckets is None else [b.index for b in buckets])

    def _install_gather_hooks(self) -> None:
        """A forward pre-hook on every module that owns parameters, waiting for
        the buckets that hold them. A module owns its direct parameters and
        those of the child modules it reads without calling them (children
        without a forward of their own: containers, parameter holders such as
        the MoE experts that a grouped GEMM reads)."""
        of_param = {id(p): b for b in self.buckets for p in b.params}

        def owned(m):
            yield from m.parameters(recurse=False)
            for c in m.children():
                if type(c).forward is nn.Module.forward:  # never called: read by m
                    yield from owned(c)

        reducer = self._reducer
        self._gather_hooks = []
        for m in self.module.modules():
            if type(m).forward is nn.Module.forward:
                continue  # not callable: its parameters belong to its parent's hook
            own = sorted({b.index for p in owned(m) if (b := of_param.get(id(p))) is not None})
            if own:
                def wait(_m, _a, own=own):
                    if reducer.gathers_pending:
                        reducer.finish_param_sync(own)
                self._gather_hooks.append(m.register_forward_pre_hook(wait))

    # ---- per-step machinery ----------------------------------------------------
    def forward(self, *args, **kwargs):
        if self._reducer.gathers_pending and not (torch.is_grad_enabled() and self.training):
            # Evaluation: collectives over the data group follow (the loss
            # average) and may not overlap a gather of the same group.
            self.finish_param_sync()
        self._reducer.prepare_forward()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def deferred_grad_sync(self):
        """Inside, the end of a backward pass does not finish the reduction:
        several backward passes make one step (pipeline schedules), and the
        caller calls :meth:`finish_grad_sync` when the step's last one is done."""
        previous = self._reducer.finish_at_backward_end
        self._reducer.finish_at_backward_end = False
        try:
            yield
        finally:
            self._reducer.finish_at_backward_end = previous

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients without communicating."""
        previous = self._reducer.sync
        self._reducer.sync = False
        try:
            yield
        finally:
            self._reducer.sync = previous

    def zero_grad_buffer(self) -> None:
        """Zeroes every bucket's gradients (float32 main gradients included)."""
        self._reducer.zero_grad_buffer()

    def finish_grad_sync(self) -> None:
        """Submits the remaining buckets, waits for all, records statistics
        (runs by itself at the end of backward outside ``deferred_grad_sync``;
        a no-op when nothing is left)."""
        self._reducer.finish_grad_sync()

    def comm_stats(self) -> dict:
        """Bytes before/after compression of the last synchronized step, per
        bucket and in total (raw = what an uncompressed fp32 ring all-reduce
        would send)."""
        raw, sent = self._reducer.last_step_stats()
        return {
            "codec": self._reducer.spec(),
            "buckets": [{"index": b.index, "numel": b.numel, "dtype": str(b.dtype),
                         "raw_bytes": b.raw_bytes, "sent_bytes": b.sent_bytes}
                        for b in self.buckets],
            "step": {"raw_bytes": raw, "sent_bytes": sent},
            "synchronized_steps": self.synchronized_steps,
        }

    # ---- checkpoint state ---------------------------------------------------------
    def codec_state_dict(self) -> dict:
        """This rank's gradient-codec state: ``{"synchronized_steps": int,
        "tensors": {"b<bucket>/<spec>/<i>": tensor}}`` (error-feedback residuals,
        PowerSGD's Q; per rank, meaningful only under the same layout)."""
        return {"synchronized_steps": self.synchronized_steps,
                "tensors": {k: t.detach() for k, t in self._reducer.codec_state().items()}}

    @torch.no_grad()
    def load_codec_state_dict(self, state: dict) -> None:
        """Restores what :meth:`codec_state_dict` returned (same model, same
        data-parallel size); codec states not yet created are created first."""
        self._reducer.load_codec_state(dict(state["tensors"]), int(state["synchronized_steps"]))

    # state_dict / parameters pass through to the wrapped module
    def state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return self.module.load_state_dict(*args, **kwargs)
