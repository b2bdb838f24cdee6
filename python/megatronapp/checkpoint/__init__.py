"""Distributed checkpoints: pickle-free, checksummed, atomic, reshardable.

    path = checkpoint.save("ckpt", iteration, chunks, optimizer, config=cfg_dict)
    info = checkpoint.load("ckpt", chunks, optimizer, config=cfg_dict)  # None if empty

Layout of one checkpoint ``<dir>/iter_0000100/``:

* ``rank<R>.safetensors`` — what rank R owns: its tensor-parallel shards of the
  model (data-parallel rank 0 only; parameters replicated over the tensor
  group from tensor rank 0 only), its optimizer state (Adam moments and step
  per parameter, or its ZeRO-1 pieces: flat ranges of parameters with their
  fp32 main values), and its own RNG states and gradient-codec error feedback.
* ``metadata.json`` — iteration, model config, parallel layout, and for every
  stored piece: the global name (layer indices are global, so names do not
  depend on the pipeline split), the global shape, the tensor-parallel slice
  and the flat range within that slice, and the file and key holding it.

Commit protocol: every rank writes and fsyncs into ``<dir>/.tmp.iter_0000100``,
barrier, rank 0 writes ``metadata.json``, fsyncs the directory, renames it to
``iter_0000100``, fsyncs ``<dir>``, then replaces ``<dir>/latest`` (write to a
temporary name, fsync, rename). A crash at any point leaves ``latest`` naming
a complete checkpoint (or no ``latest`` at all).

Loading reads, for each of this rank's tensors, the byte ranges of the stored
pieces that overlap its slice, straight into the tensor (positioned reads on a
thread pool, CRC-32 per stored piece, checked shapes and coverage, never a
global tensor in memory), so a checkpoint saved at one (tp, pp, dp, ZeRO or
not) loads into another, whatever the size of its tensors. RNG states and
codec error feedback are per rank and are restored only under the same layout
(elsewhere they restart, with a warning).

Everything that touches the files (the tensor files, the commit, the streamed
reads) is the C++ file engine's (``include/mapp/torch/checkpoint_engine.h``),
which the C++ trainers' checkpoints use too; this module only collects what
this rank saves and where each tensor loads.
"""

from __future__ import annotations

import json
import os
import re

import torch.distributed as dist

import torch

from .. import _C, _collectives
from ..distributed.data_parallel import DistributedDataParallel
from ..optimizer import MixedPrecisionOptimizer
from ..parallel_state import resolve_state
from ..tensor_parallel.utils import partition_view, split_over
from .format import CheckpointError, engine_errors, read
from .stream import DEFAULT_BUDGET, StreamLoader, TensorFile

__all__ = ["save", "load", "latest", "wait_pending", "AsyncSave", "AsyncLoad", "CheckpointError",
           "global_named_parameters", "tensor_parallel_slice", "read_metadata"]

FORMAT_VERSION = _C.checkpoint_format


# ---- names and slices --------------------------------------------------------------
def _module(chunk):
    return getattr(chunk, "module", chunk)


def _global_name(module, local: str) -> str:
    """Layer indices of a pipeline chunk are local; make them global."""
    numbers = getattr(module, "layer_numbers", None)
    m = re.match(r"layers\.(\d+)\.(.*)", local)
    if numbers is not None and m:
        return f"layers.{numbers[int(m.group(1))]}.{m.group(2)}"
    return local


def _finish_param_sync(chunks) -> None:
    """ZeRO-1 with overlap_param_gather: the parameters are complete only once
    their all-gathers in flight are done."""
    for c in chunks:
        finish = getattr(c, "finish_param_sync", None)
        if finish is not None:
            finish()


def _params(chunks) -> list:
    """(global name, param) of every parameter of this rank's chunks."""
    out = []
    for c in chunks:
        mod = _module(c)
        for n, p in mod.named_parameters():
            out.append((_global_name(mod, n), p))
    return out


def _buffers(chunks) -> list:
    """(global name, buffer) of the buffers a module lists in its
    ``_checkpointed_buffers`` (state that is not a parameter but must survive
    a resume: the router's expert bias)."""
    out = []
    for c in chunks:
        mod = _module(c)
        for prefix, m in mod.named_modules():
            for b in getattr(m, "_checkpointed_buffers", ()):
                t = getattr(m, b, None)
                if t is not None:
                    out.append((_global_name(mod, f"{prefix}.{b}" if prefix else b), t))
    return out


def global_named_parameters(chunks) -> dict:
    """{global name: parameter} of this rank's chunks (layer indices global,
    as in checkpoints)."""
    return dict(_params(chunks))


def tensor_parallel_slice(p, state):
    """(dim, start, end) of this rank's shard of `p` in the global tensor,
    or None for a replicated parameter."""
    return _tp_slice(p, state)


def _tp_slice(p, state):
    """(dim, start, end) of this rank's shard in the global tensor, or None.
    A stacked parameter (SwiGLU's fc1) is sliced in its partition view
    ``[k, rows/k, ...]``, where the shard is contiguous."""
    view, dim = partition_view(p)
    if dim is None:
        return None
    n, rank = view[dim], split_over(p, state)[1]
    return (dim, rank * n, (rank + 1) * n)


def _global_shape(p, state):
    sl = _tp_slice(p, state)
    shape = list(partition_view(p)[0])
    if sl is not None:
        shape[sl[0]] *= split_over(p, state)[0]
    return shape


def _owner_of_model_copy(p, state) -> bool:
    """Exactly one rank stores each model piece. An MoE expert (named by its
    global id) lives on one expert-parallel rank: the first rank of its
    expert-data-parallel group stores it (the expert grid spans the context
    ranks too); other pieces, data and context rank 0."""
    if getattr(p, "expert_parallel", False):
        first = state.edp_rank == 0
    else:
        first = state.dp_rank == 0 and state.cp_rank == 0
    if not first or getattr(p, "shared_embedding_replica", False):
        return False
    return _tp_slice(p, state) is not None or state.tp_rank == 0


# ---- save ---------------------------------------------------------------------------------
def _optimizer_pieces(optimizer, params, state):
    """[(global name, kind, flat_lo, tensor)] of the optimizer state this rank
    must store, plus the parameter each refers to."""
    pieces = []
    if optimizer is None:
        return pieces
    if isinstance(optimizer, MixedPrecisionOptimizer):  # fp32 main values (ZeRO: shards)
        name_of = {id(p): n for n, p in params}
        for sh in optimizer.shards():
            p = sh.param
            if getattr(p, "shared_embedding_replica", False):
                continue
            if _tp_slice(p, state) is None and state.tp_rank != 0:
                continue
            if not optimizer.sharded and not _owner_of_model_copy(p, state):
                continue  # every data-parallel rank holds the same full copy
            lo = sh.lo
            pieces.append((name_of[id(p)], "main", lo, sh.main.detach(), p))
            for kind, t in sh.state.items():
                if torch.is_tensor(t):
                    pieces.append((name_of[id(p)], kind, lo if t.dim() else -1, t.detach(), p))
        return pieces
    for n, p in params:  # a plain optimizer: state shaped like the parameter
        if not _owner_of_model_copy(p, state):
            continue
        for kind, t in optimizer.state.get(p, {}).items():
            if torch.is_tensor(t):
                pieces.append((n, kind, 0 if t.dim() else -1, t.detach().reshape(-1)
                               if t.dim() else t.detach(), p))
    return pieces


def save(directory: str, iteration: int, chunks, optimizer=None, *, config: dict | None = None,
         extra: dict | None = None, parallel_state=None, async_save: bool = False):
    """Collective: every rank calls it. Returns the committed checkpoint path,
    or with ``async_save=True`` an :class:`AsyncSave` once the state has been
    copied to host memory (the blocking part): files are written, fsynced and
    committed by a background thread, ranks meeting through the store (no
    collective), and ``latest`` moves only when everything is durable. A new
    save first waits for the previous one."""
    global _PENDING
    if _PENDING is not None:
        _PENDING.wait()
        _PENDING = None
    state = resolve_state(parallel_state)
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    _finish_param_sync(chunks)
    rank = dist.get_rank()
    name = _C.checkpoint_name(iteration)
    if rank == 0:
        with engine_errors():
            _C.checkpoint_begin(directory, name)
    dist.barrier()
    params = _params(chunks)
    tensors, index = {}, []
    fname = f"rank{rank}.safetensors"
    for n, p in params:
        if _owner_of_model_copy(p, state):
            key = f"model/{n}"
            tensors[key] = p.detach()
            index.append({"name": n, "kind": "param", "global_shape": _global_shape(p, state),
                          "dtype": str(p.dtype), "tp_slice": _tp_slice(p, state),
                          "flat": [0, p.numel()], "file": fname, "key": key})
    for n, b in _buffers(chunks):  # replicated state: stored once, as a parameter is
        if _owner_of_model_copy(b, state):
            key = f"model/{n}"
            tensors[key] = b.detach()
            index.append({"name": n, "kind": "param", "global_shape": list(b.shape),
                          "dtype": str(b.dtype), "tp_slice": None, "flat": [0, b.numel()],
                          "file": fname, "key": key})
    for n, kind, lo, t, p in _optimizer_pieces(optimizer, params, state):
        key = f"optim/{n}/{kind}@{lo}"
        tensors[key] = t.reshape(-1) if t.dim() else t
        index.append({"name": n, "kind": kind, "global_shape": _global_shape(p, state),
                      "dtype": str(t.dtype), "tp_slice": _tp_slice(p, state),
                      "flat": [lo, lo + t.numel()] if lo >= 0 else None,
                      "file": fname, "key": key})
    # Per-rank state: RNG and codec error feedback (restored under the same layout).
    tensors["rank/rng_cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rank/rng_cuda"] = torch.cuda.get_rng_state()
    ddp_meta = []
    for ci, c in enumerate(chunks):
        if not isinstance(c, DistributedDataParallel):
            continue
        codec = c.codec_state_dict()
        ddp_meta.append({"chunk": ci, "sync_steps": codec["synchronized_steps"]})
        for key, t in codec["tensors"].items():
            tensors[f"rank/ddp{ci}/{key}"] = t
    if async_save:  # the blocking part: a host copy of everything
        tensors = {k: t.detach().to("cpu", copy=True) for k, t in tensors.items()}
    meta = {"format": FORMAT_VERSION, "iteration": iteration, "config": config or {},
            "extra": extra or {},
            "parallel": {"world": dist.get_world_size(), "tp": state.tp_size, "pp": state.pp_size,
                         "dp": state.dp_size, "ep": state.ep_size, "cp": state.cp_size,
                         "etp": state.etp_size, "vpp": len(chunks)}}
    _SAVE_SEQ[0] += 1
    # The engine writes, meets the other ranks through the store (no
    # collective: it may run on a background thread) and rank 0 commits.
    with engine_errors():
        out = _C.checkpoint_save(
            directory, name, rank, dist.get_world_size(), list(tensors.items()),
            json.dumps(index), json.dumps(ddp_meta),
            [("rank", str(rank)), ("iteration", str(iteration))], json.dumps(meta),
            _collectives.default_store(), f"mapp_ckpt/{_SAVE_SEQ[0]}/", async_save)
    if async_save:
        _PENDING = AsyncSave(out)
        return _PENDING
    return out


_SAVE_SEQ = [0]
_PENDING = None


class AsyncSave:
    """A checkpoint being written in the background (the engine's
    ``AsyncCheckpointSave``); ``wait()`` returns its committed path
    (re-raising a failure)."""

    def __init__(self, job):
        self.job = job
        self.error = None
        self.path = None

    def done(self) -> bool:
        return self.job.done()

    def wait(self) -> str:
        if self.path is None and self.error is None:
            try:
                with engine_errors():
                    self.path = self.job.wait()
            except BaseException as e:  # noqa: BLE001 - kept, re-raised on every wait()
                self.error = e
        if self.error is not None:
            raise self.error
        return self.path


def wait_pending() -> None:
    """Blocks until an asynchronous save in flight is committed."""
    global _PENDING
    if _PENDING is not None:
        pending, _PENDING = _PENDING, None
        pending.wait()


# ---- load ---------------------------------------------------------------------------------
def latest(directory: str) -> str | None:
    """The checkpoint `directory/latest` names (None if there is none)."""
    with engine_errors():
        return _C.checkpoint_latest(directory)


def read_metadata(directory_or_path: str) -> tuple[str, dict] | None:
    """(path, metadata) of a checkpoint (a directory's latest, or an iter_*
    path), None when the directory has none; CheckpointError if corrupt."""
    with engine_errors():
        found = _C.checkpoint_read_metadata(directory_or_path)
    return None if found is None else (found[0], json.loads(found[1]))


@torch.no_grad()
def load(directory_or_path: str, chunks, optimizer=None, *, config: dict | None = None,
         parallel_state=None, verify: bool = True, async_load: bool = False,
         budget: int = DEFAULT_BUDGET, threads: int | None = None):
    """Loads the latest checkpoint of a directory (or a given iter_* path) into
    this rank's chunks and optimizer. Collective-free; returns {"iteration",
    "config", "extra", "same_layout", "path"} or None when the directory has no
    checkpoint. Raises CheckpointError (naming file and tensor) on anything
    corrupt or incompatible, including a model `config` that differs.

    Each rank reads only the stored bytes overlapping its own slices, straight
    into its tensors, on `threads` worker threads holding at most `budget`
    bytes of buffer each (``checkpoint.stream``); no global tensor is built.
    ``verify=False`` skips the CRC-32 checks of the pieces read (faster; a
    corrupted file then loads silently). ``async_load=True`` returns an
    :class:`AsyncLoad` as soon as the reads are queued: build the rest of the
    job (data loaders, ...) meanwhile and call its ``wait()`` (which returns
    the dict above) before touching the model or the optimizer."""
    state = resolve_state(parallel_state)
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    _finish_param_sync(chunks)
    found = read_metadata(directory_or_path)
    if found is None:
        return None
    path, meta = found
    if config is not None and meta.get("config"):
        diff = {k: (meta["config"].get(k), v) for k, v in config.items()
                if k in meta["config"] and meta["config"][k] != v}
        if diff:
            raise CheckpointError(f"{path}: checkpoint from an incompatible model: " + ", ".join(
                f"{k} = {a} in the checkpoint, {b} here" for k, (a, b) in sorted(diff.items())))
    ld = StreamLoader(path, meta, verify=verify, budget=budget, threads=threads)
    try:
        _queue_reads(ld, chunks, optimizer, state)
    except BaseException:
        ld.wait_quietly()
        raise
    job = AsyncLoad(ld, path, meta, chunks, state)
    return job if async_load else job.wait()


def _queue_reads(ld, chunks, optimizer, state) -> None:
    params = _params(chunks)

    def src(n, p):
        return "word_embeddings.weight" if getattr(p, "shared_embedding_replica", False) else n

    for n, p in params:
        ld.into(src(n, p), "param", p.data, _tp_slice(p, state), _global_shape(p, state))
    for n, b in _buffers(chunks):  # (checkpoints before 2026-12-06 did not store them)
        if ld.has(n, "param"):
            ld.into(n, "param", b, None, list(b.shape))
    if optimizer is None:
        return
    if isinstance(optimizer, MixedPrecisionOptimizer):
        name_of = {id(p): n for n, p in params}
        for sh in optimizer.shards():
            p = sh.param
            n = src(name_of[id(p)], p)
            sl, gshape, flat = _tp_slice(p, state), _global_shape(p, state), (sh.lo, sh.hi)
            ld.into(n, "main" if ld.has(n, "main") else "param", sh.main, sl, gshape, flat)
            st = {}
            for kind in _state_kinds(ld, n):
                st[kind] = torch.empty(sh.hi - sh.lo, dtype=torch.float32, device=sh.main.device)
                ld.into(n, kind, st[kind], sl, gshape, flat)
            if ld.has(n, "step"):
                st["step"] = ld.scalar(n, "step").clone()
            if st:
                sh.state.clear()
                sh.state.update(st)
        return
    for n, p in params:
        n = src(n, p)
        st = {}
        for kind in _state_kinds(ld, n):
            st[kind] = torch.empty(p.shape, dtype=p.dtype, device=p.device)
            ld.into(n, kind, st[kind], _tp_slice(p, state), _global_shape(p, state))
        if ld.has(n, "step"):
            st["step"] = ld.scalar(n, "step").clone()
        if st:
            optimizer.state[p] = st


def _state_kinds(ld, name) -> list:
    """The optimizer state tensors shaped like parameter `name` that the
    checkpoint holds (AdamW's exp_avg / exp_avg_sq, SGD's momentum_buffer;
    not the weights, not the scalar step)."""
    return sorted(k for k in ld.kinds(name) if k not in ("param", "main", "step"))


class AsyncLoad:
    """A load whose reads run in the background (``load(..., async_load=True)``)."""

    def __init__(self, loader, path, meta, chunks, state):
        self.loader, self.path, self.meta, self.chunks, self.state = (loader, path, meta, chunks,
                                                                      state)
        self.result = None

    def done(self) -> bool:
        return self.result is not None or self.loader.done()

    def wait(self) -> dict:
        """Blocks until every read and check is done; returns load()'s dict."""
        if self.result is None:
            self.loader.wait()
            self.result = _restore_rank_state(self.path, self.meta, self.chunks, self.state)
        return self.result


def _restore_rank_state(path, meta, chunks, state) -> dict:
    """RNG and codec error feedback, under the saving layout only."""
    par = meta["parallel"]
    same = (par.get("world") == dist.get_world_size() and par.get("tp") == state.tp_size
            and par.get("pp") == state.pp_size and par.get("dp") == state.dp_size
            and par.get("ep", 1) == state.ep_size and par.get("cp", 1) == state.cp_size
            and par.get("etp", par.get("tp")) == state.etp_size
            and par.get("vpp") == len(chunks))
    rank = dist.get_rank()
    if same:
        mine, _ = read(os.path.join(path, f"rank{rank}.safetensors"),
                       names=_rank_keys(path, rank))
        torch.set_rng_state(mine["rank/rng_cpu"])
        if "rank/rng_cuda" in mine and torch.cuda.is_available():
            torch.cuda.set_rng_state(mine["rank/rng_cuda"])
        for entry in meta.get("ddp", {}).get(str(rank), []):
            prefix = f"rank/ddp{entry['chunk']}/"
            if not hasattr(chunks[entry["chunk"]], "load_codec_state_dict"):
                continue  # loading into a bare model (inference): no gradient codec
            chunks[entry["chunk"]].load_codec_state_dict({
                "synchronized_steps": entry["sync_steps"],
                "tensors": {k[len(prefix):]: t for k, t in mine.items() if k.startswith(prefix)}})
    elif rank == 0:
        _C.log("warning", f"checkpoint {path} was saved with layout {par}; loading into tp="
               f"{state.tp_size} pp={state.pp_size} dp={state.dp_size}: parameters and "
               "optimizer state resharded, RNG and gradient-codec error feedback restart")
    return {"iteration": meta["iteration"], "config": meta.get("config", {}),
            "extra": meta.get("extra", {}), "same_layout": same, "path": path}


def _rank_keys(path, rank) -> list:
    """The per-rank keys (rank/...) of a rank file: only those are read."""
    return [k for k in TensorFile(os.path.join(path, f"rank{rank}.safetensors")).entries
            if k.startswith("rank/")]
