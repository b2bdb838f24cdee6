"""Data-parallel engine: bucketed, overlapped, optionally compressed gradient sync.

    model = mapp.data_parallel.DistributedDataParallel(model, compression="int8")
    loss = model(x, y).mean(); loss.backward()   # grads averaged when backward returns
    optimizer.step()

How it works:

* Gradients live in contiguous per-bucket buffers (one dtype per bucket,
  about `bucket_size_mb` each, parameters in reverse registration order so the
  first buckets fill first during backward); each ``param.grad`` is a view
  into its bucket.
* A post-accumulate-grad hook marks parameters ready; when a bucket is
  complete its reduction is submitted to the group's communication thread
  (C++, ``torch.ops.mapp.compressed_all_reduce_async``) while backward goes
  on. Buckets are submitted strictly in order, so every rank issues the same
  sequence of collectives even when readiness order differs.
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
  post-accumulate hook adds ``param.grad`` into it and frees ``param.grad``
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
import weakref
from dataclasses import dataclass, field

import torch.distributed as dist

import torch
from torch import nn

from .. import _C, _collectives, autograd
from .. import trace as _trace
from ..parallel_state import ParallelState, get_parallel_state
from ..tensor_parallel.utils import is_tensor_parallel
from .comm import codec_state, parse_compression

__all__ = ["DistributedDataParallel"]


@dataclass
class Bucket:
    index: int
    params: list
    offsets: list  # element offset of each param in the bucket
    numel: int
    dtype: torch.dtype  # of the parameters
    grad_data: torch.Tensor  # float32 when the parameters keep main gradients
    param_data: torch.Tensor | None = None  # ZeRO-1: params are views into this
    layout: list = field(default_factory=list)  # flattened (offset, rows, cols) of 2-D params
    state: dict = field(default_factory=dict)  # codec spec -> state tensors
    shard: torch.Tensor | None = None  # ZeRO-1: this rank's averaged fp32 grad chunk
    ready: set = field(default_factory=set)
    handle: object | None = None  # the CommWork of the reduction in flight
    gather: object | None = None  # ZeRO-1 overlap_param_gather: the parameter all-gather in flight
    raw_bytes: int = 0
    sent_bytes: int = 0
    exact: bool = False  # never compressed (TP-replicated parameters)
    # MoE experts: reduced over the expert-data-parallel group instead, and
    # pre-scaled by 1 / ep so that the average is over all data ranks.
    expert: bool = False
    group: object = None  # the bucket's reduction group (set by the DDP)


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
        broadcast_parameters: copy rank 0's parameters to every rank first.
        grad_reduce_in_fp32: accumulate and reduce the gradients of non-fp32
            parameters in float32 ``param.main_grad`` buffers.
    """

    def __init__(self, module: nn.Module, *, process_group: dist.ProcessGroup | None = None,
                 bucket_size_mb: float = 25, compression=None, overlap_grad_reduce: bool = True,
                 broadcast_parameters: bool = True, grad_reduce_in_fp32: bool = False,
                 parallel_state: ParallelState | None = None):
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
        self._sync_enabled = True
        # False inside deferred_grad_sync(): the caller finishes the step.
        self._finish_at_backward_end = True
        self._zero = False
        self._callback_queued = False
        self._sync_steps = 0
        self._step_stats = {"raw_bytes": 0, "sent_bytes": 0}
        self._gathers_pending = False
        self._gather_hooks = None  # installed by the first start_param_sync()
        self._build_buckets()
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(p))
                       for b in self.buckets for p in b.params]

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

    def _build_buckets(self) -> None:
        params = [p for p in self.module.parameters() if p.requires_grad]
        params.reverse()  # backward produces the last layers' grads first
        self.buckets = []
        current, size = {}, {}
        for p in params:
            if getattr(p, "shared_embedding", False):
                # Own bucket: its ZeRO-1 shard is then the same slice of the
                # weight on the first and last pipeline stage, so the two
                # shards can be summed over the embedding group.
                self._add_bucket([p])
                continue
            key = (p.dtype, self._exact_replicated and not is_tensor_parallel(p),
                   getattr(p, "expert_parallel", False))
            lst = current.setdefault(key, [])
            lst.append(p)
            size[key] = size.get(key, 0) + p.numel() * p.element_size()
            if size[key] >= self.bucket_size:
                self._add_bucket(lst, exact=key[1], expert=key[2])
                current[key], size[key] = [], 0
        for key, lst in current.items():
            if lst:
                self._add_bucket(lst, exact=key[1], expert=key[2])
        self._param_bucket = {p: b for b in self.buckets for p in b.params}

    def _add_bucket(self, params: list, exact: bool = False, expert: bool = False) -> None:
        offsets, n, layout = [], 0, []
        for p in params:
            offsets.append(n)
            if p.dim() == 2:
                layout += [n, p.shape[0], p.shape[1]]
            n += p.numel()
        dtype, device = params[0].dtype, params[0].device
        grad_dtype = torch.float32 if self.grad_reduce_in_fp32 else dtype
        grad = torch.zeros(n, dtype=grad_dtype, device=device)
        b = Bucket(index=len(self.buckets), params=params, offsets=offsets, numel=n,
                   dtype=dtype, grad_data=grad, layout=layout, exact=exact, expert=expert,
                   group=self.expert_group if expert else self.group)
        self.buckets.append(b)
        self._attach_grads(b, zero=True)

    @staticmethod
    def _keeps_main_grad(b: Bucket) -> bool:
        return b.grad_data.dtype != b.dtype

    def _attach_grads(self, b: Bucket, zero: bool) -> None:
        for p, off in zip(b.params, b.offsets, strict=True):
            view = b.grad_data[off: off + p.numel()].view_as(p)
            if self._keeps_main_grad(b):
                # Zeroed by zero_grad_buffer only: microbatches accumulate here.
                if getattr(p, "main_grad", None) is None or p.main_grad.data_ptr() != view.data_ptr():
                    if zero and getattr(p, "main_grad", None) is None:
                        view.zero_()
                    p.main_grad = view
                continue
            if p.grad is None:
                if zero:
                    view.zero_()
                p.grad = view
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)  # the user replaced .grad: adopt its values
                p.grad = view

    @property
    def uses_distributed_optimizer(self) -> bool:
        """True once a ZeRO-1 optimizer switched the buckets to reduce-scatter."""
        return self._zero

    @property
    def synchronized_steps(self) -> int:
        """Backward passes whose gradients were synchronized (the codec warm-up
        of ``Compression(start_iter=...)`` counts these)."""
        return self._sync_steps

    def enable_distributed_optimizer(self) -> None:
        """Switches to ZeRO-1 mode: parameters become views into contiguous
        per-bucket buffers and reductions become reduce-scatters. Called by
        DistributedOptimizer before the first backward.

        Buffers are padded to a multiple of world x the codec's block, so the
        shard each rank owns is the same for every codec (warm-up included)."""
        if self._zero:
            return
        self._zero = True
        lossy = self.compression.spec if self.compression else "none"
        with torch.no_grad():
            for b in self.buckets:
                spec = "none" if b.exact else lossy
                world = b.group.size()
                padded = torch.ops.mapp.codec_padded_chunk(spec, b.numel, world) * world
                grad = torch.zeros(padded, dtype=b.grad_data.dtype, device=b.grad_data.device)
                grad[: b.numel].copy_(b.grad_data)
                b.grad_data = grad
                for p in b.params:
                    p.grad = None
                    p.main_grad = None
                self._attach_grads(b, zero=False)
                b.param_data = torch.zeros(padded, dtype=b.dtype, device=grad.device)
                for p, off in zip(b.params, b.offsets, strict=True):
                    b.param_data[off: off + p.numel()].copy_(p.data.reshape(-1))
                    p.data = b.param_data[off: off + p.numel()].view_as(p)
                b.shard = torch.zeros(padded // world, dtype=torch.float32, device=grad.device)
                b.state.clear()

    # ---- ZeRO-1: the parameter all-gather, overlapped with the next forward --------
    def start_param_sync(self) -> None:
        """Submits every bucket's parameter all-gather (ZeRO-1: each rank's
        updated chunk of ``param_data`` to all) on the bucket group's
        communication thread and returns at once. A forward pre-hook of each
        module waits for the buckets of its own parameters just before it
        runs, so the gathers overlap the next forward (Megatron-LM's
        ``--overlap-param-gather``); :meth:`finish_param_sync` waits for all."""
        if not self._zero:
            raise RuntimeError("start_param_sync needs ZeRO-1 buckets (DistributedOptimizer)")
        self.finish_param_sync()
        if self._gather_hooks is None:
            self._install_gather_hooks()
        for b in self.buckets:
            if b.group.size() > 1:
                b.gather = torch.ops.mapp.param_all_gather_async(b.param_data, b.group.group_name)
        self._gathers_pending = any(b.gather is not None for b in self.buckets)

    def finish_param_sync(self, buckets=None) -> None:
        """Waits for the parameter all-gathers in flight (of `buckets`, default
        all). Anything that reads or writes the parameters outside a forward
        (checkpoints, the optimizer, evaluation) calls it first; cheap when
        nothing is in flight."""
        if not self._gathers_pending:
            return
        for b in (self.buckets if buckets is None else buckets):
            if b.gather is not None:
                work, b.gather = b.gather, None
                with _trace.scope("param_gather_wait", "collective", lane=0):
                    work.wait()
        self._gathers_pending = any(b.gather is not None for b in self.buckets)

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

        self._gather_hooks = []
        for m in self.module.modules():
            if type(m).forward is nn.Module.forward:
                continue  # not callable: its parameters belong to its parent's hook
            own = {b.index: b for p in owned(m) if (b := of_param.get(id(p))) is not None}
            if own:
                buckets = list(own.values())
                self._gather_hooks.append(m.register_forward_pre_hook(
                    lambda _m, _a, bs=buckets: self.finish_param_sync(bs)))

    # ---- per-step machinery ----------------------------------------------------
    def forward(self, *args, **kwargs):
        if self._gathers_pending and not (torch.is_grad_enabled() and self.training):
            # Evaluation: collectives over the data group follow (the loss
            # average) and may not overlap a gather of the same group.
            self.finish_param_sync()
        for b in self.buckets:
            self._attach_grads(b, zero=True)
            b.ready.clear()
            b.handle = None
        self._next_bucket = 0
        self._callback_queued = False
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def deferred_grad_sync(self):
        """Inside, the end of a backward pass does not finish the reduction:
        several backward passes make one step (pipeline schedules), and the
        caller calls :meth:`finish_grad_sync` when the step's last one is done."""
        previous = self._finish_at_backward_end
        self._finish_at_backward_end = False
        try:
            yield
        finally:
            self._finish_at_backward_end = previous

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients without communicating."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def zero_grad_buffer(self) -> None:
        """Zeroes every bucket's gradients (float32 main gradients included)."""
        for b in self.buckets:
            b.grad_data.zero_()

    def _make_hook(self, p):
        main = self._keeps_main_grad(self._param_bucket[p])
        # The hook lives in the parameter's C++ state, where the garbage
        # collector cannot see it: a strong reference back to this module (or
        # to the parameter itself) would keep them, and the process groups,
        # alive forever. The parameter comes as the argument.
        ref = weakref.ref(self)

        def hook(param):
            self = ref()
            if self is None:
                return
            if main and param.grad is not None:
                param.main_grad.add_(param.grad)  # float32 accumulation
                param.grad = None
            if not self._sync_enabled or autograd.is_deferred(param):
                return
            if not self._callback_queued:
                self._callback_queued = True
                if self._finish_at_backward_end:
                    torch.autograd.Variable._execution_engine.queue_callback(  # noqa: SLF001
                        self.finish_grad_sync)
            b = self._param_bucket[param]
            b.ready.add(id(param))
            if self.overlap_grad_reduce:
                self._launch_ready()
        return hook

    def _spec(self, b: Bucket | None = None) -> str:
        c = self.compression
        if c is None or self._sync_steps < c.start_iter or (b is not None and b.exact):
            return "none"
        return c.spec

    def _launch(self, b: Bucket) -> None:
        spec = self._spec(b)
        state = self._codec_state(b, spec)
        name = b.group.group_name
        if b.expert and self.expert_scale != 1.0:
            # Summed over ep ranks' tokens by the dispatcher already; the
            # reduction averages over edp: edp/dp more makes it 1/dp.
            b.grad_data.mul_(self.expert_scale)
        if self._zero:
            b.handle = torch.ops.mapp.compressed_reduce_scatter_async(
                b.grad_data, spec, state, b.layout, b.shard, True, name)
        else:
            b.handle = torch.ops.mapp.compressed_all_reduce_async(
                b.grad_data, spec, state, b.layout, True, name)

    def _launch_ready(self) -> None:
        while (self._next_bucket < len(self.buckets)
               and len(self.buckets[self._next_bucket].ready)
               == len(self.buckets[self._next_bucket].params)):
            self._launch(self.buckets[self._next_bucket])
            self._next_bucket += 1

    def finish_grad_sync(self) -> None:
        """Submits the remaining buckets, waits for all, records statistics."""
        # Parameters no forward touched this step (an expert without tokens)
        # still have their gather in flight: finish it before the step's
        # collectives over the data group.
        self.finish_param_sync()
        if not self._callback_queued:
            return  # nothing started in this backward (or already finished)
        self._callback_queued = False
        while self._next_bucket < len(self.buckets):
            self._launch(self.buckets[self._next_bucket])
            self._next_bucket += 1
        step = {"raw_bytes": 0, "sent_bytes": 0}
        with _trace.scope("dp_wait", "collective", lane=0):  # the training thread waits
            for b in self.buckets:
                if b.handle is not None:
                    b.raw_bytes, b.sent_bytes = b.handle.wait()
                    b.handle = None
                    step["raw_bytes"] += b.raw_bytes
                    step["sent_bytes"] += b.sent_bytes
        self._step_stats = step
        self._sync_steps += 1

    def comm_stats(self) -> dict:
        """Bytes before/after compression of the last synchronized step, per
        bucket and in total (raw = what an uncompressed fp32 ring all-reduce
        would send)."""
        return {
            "codec": self._spec(),
            "buckets": [{"index": b.index, "numel": b.numel, "dtype": str(b.dtype),
                         "raw_bytes": b.raw_bytes, "sent_bytes": b.sent_bytes}
                        for b in self.buckets],
            "step": dict(self._step_stats),
            "synchronized_steps": self._sync_steps,
        }

    # ---- checkpoint state ---------------------------------------------------------
    def codec_state_dict(self) -> dict:
        """This rank's gradient-codec state: ``{"synchronized_steps": int,
        "tensors": {"b<bucket>/<spec>/<i>": tensor}}`` (error-feedback residuals,
        PowerSGD's Q; per rank, meaningful only under the same layout)."""
        tensors = {}
        for b in self.buckets:
            for spec, state in b.state.items():
                for i, t in enumerate(state):
                    tensors[f"b{b.index}/{spec}/{i}"] = t.detach()
        return {"synchronized_steps": self._sync_steps, "tensors": tensors}

    @torch.no_grad()
    def load_codec_state_dict(self, state: dict) -> None:
        """Restores what :meth:`codec_state_dict` returned (same model, same
        data-parallel size); codec states not yet created are created first."""
        self._sync_steps = int(state["synchronized_steps"])
        for key, t in state["tensors"].items():
            b, spec, i = key.split("/")
            bucket = self.buckets[int(b[1:])]
            self._codec_state(bucket, spec)[int(i)].copy_(t)

    def _codec_state(self, b: Bucket, spec: str) -> list:
        if spec not in b.state:
            b.state[spec] = codec_state(spec, b.grad_data.numel(), b.group.size(), b.layout,
                                        b.grad_data.device, seed=b.index)
        return b.state[spec]

    # state_dict / parameters pass through to the wrapped module
    def state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return self.module.load_state_dict(*args, **kwargs)
