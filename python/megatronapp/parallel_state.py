"""Hybrid-parallel topology: the rank grid and its torch.distributed groups.

Topology is a value, :class:`ParallelState`, that the library passes around
explicitly. The Megatron-compatible functions in this module
(``get_tensor_model_parallel_rank()`` and friends) are a thin façade over one
default instance, set by :func:`initialize_model_parallel`, so Megatron-style
scripts work unchanged.

Rank order is Megatron's: tensor-parallel rank varies fastest, then data, then
pipeline::

    rank = pp_rank * dp * tp + dp_rank * tp + tp_rank

The math lives in C++ (``megatronapp.RankGrid``, ``src/topology/rank_grid.cc``);
this module only turns its groups into process groups.
"""

from __future__ import annotations

import os
import secrets
import socket
import warnings
from dataclasses import dataclass, field

import torch.distributed as dist

import torch

from ._C import RankGrid

__all__ = [
    "ParallelState",
    "initialize_model_parallel",
    "create_parallel_state",
    "resolve_state",
    "destroy_model_parallel",
    "model_parallel_is_initialized",
    "get_parallel_state",
    "new_groups",
]


@dataclass
class ParallelState:
    """The grid, this rank's coordinates and the process groups it belongs to.

    Groups are ``torch.distributed.ProcessGroup`` objects; pass
    ``group.group_name`` to the C++ collectives (``torch.ops.mapp.*``).
    """

    grid: RankGrid
    rank: int
    tensor_group: dist.ProcessGroup
    data_group: dist.ProcessGroup
    pipeline_group: dist.ProcessGroup
    model_group: dist.ProcessGroup  # tensor x pipeline: one full model replica
    embedding_group: dist.ProcessGroup | None  # first + last stage; None if not a member
    virtual_pipeline_size: int | None = None
    virtual_pipeline_rank: int | None = None
    # ranks of this rank's groups, for messages and tests
    group_ranks: dict = field(default_factory=dict)
    #: the ranks sharding the experts with this one (None when ep == 1)
    expert_group: dist.ProcessGroup | None = None
    #: the ranks holding the same experts: expert gradients are reduced over
    #: it (the data group when ep == 1)
    expert_data_group: dist.ProcessGroup | None = None
    #: the ranks holding the other shards of this rank's experts (size etp;
    #: the tensor group when etp == tp, None when etp == 1)
    expert_tensor_group: dist.ProcessGroup | None = None
    #: the tensor ranks routing the other slices of this rank's tokens when
    #: etp < tp (same etp rank; None when etp == tp)
    expert_token_group: dist.ProcessGroup | None = None
    #: the ranks splitting one sequence with this one (None when cp == 1)
    context_group: dist.ProcessGroup | None = None
    #: data x context ranks: the replicas of the dense weights when cp > 1
    #: (what their gradients are reduced over); None when cp == 1
    data_context_group: dist.ProcessGroup | None = None

    @property
    def cp_size(self) -> int:
        return self.grid.cp

    @property
    def cp_rank(self) -> int:
        return self.grid.coord(self.rank).cp

    @property
    def ep_size(self) -> int:
        return self.grid.ep

    @property
    def ep_rank(self) -> int:
        return self.grid.ep_rank(self.rank)

    @property
    def edp_size(self) -> int:
        return self.grid.edp

    @property
    def edp_rank(self) -> int:
        return self.grid.edp_rank(self.rank)

    @property
    def etp_size(self) -> int:
        return self.grid.etp

    @property
    def etp_rank(self) -> int:
        return self.grid.etp_rank(self.rank)

    @property
    def expert_token_index(self) -> int:
        """Which of the tp / etp token slices this rank's experts see."""
        return self.tp_rank // self.grid.etp

    def expert_norm_groups(self, sharded: bool = False) -> list | None:
        """The groups an expert gradient's squares are summed over so that each
        expert shard counts once: its expert-parallel, expert-tensor and
        pipeline peers, and with ZeRO-1 `sharded` gradients its
        expert-data-parallel peers too (each holds one slice). None without an
        expert grid (ep == 1 and etp == tp): experts are then tensor-parallel
        parameters replicated like the dense ones. Every rank of the grid
        agrees, whether or not its stage holds an MoE layer."""
        if self.ep_size == 1 and self.etp_size == self.tp_size:
            return None
        groups = [self.expert_group, self.expert_tensor_group, self.pipeline_group]
        if sharded:
            groups.insert(0, self.expert_data_group_or_data())
        return [g for g in groups if g is not None and g.size() > 1]

    def expert_data_group_or_data(self) -> dist.ProcessGroup:
        """The ranks holding this rank's experts: the expert-data group of an
        expert grid, else every data (x context) rank, as for dense weights."""
        if self.expert_data_group is not None:
            return self.expert_data_group
        return self.data_context_group or self.data_group

    @property
    def tp_rank(self) -> int:
        return self.grid.coord(self.rank).tp

    @property
    def dp_rank(self) -> int:
        return self.grid.coord(self.rank).dp

    @property
    def pp_rank(self) -> int:
        return self.grid.coord(self.rank).pp

    @property
    def tp_size(self) -> int:
        return self.grid.tp

    @property
    def dp_size(self) -> int:
        return self.grid.dp

    @property
    def pp_size(self) -> int:
        return self.grid.pp

    def is_pipeline_first_stage(self, ignore_virtual: bool = False) -> bool:
        if not ignore_virtual and self.virtual_pipeline_size is not None:
            if self.virtual_pipeline_rank not in (None, 0):
                return False
        return self.pp_rank == 0

    def is_pipeline_last_stage(self, ignore_virtual: bool = False) -> bool:
        if not ignore_virtual and self.virtual_pipeline_size is not None:
            if self.virtual_pipeline_rank not in (None, self.virtual_pipeline_size - 1):
                return False
        return self.pp_rank == self.pp_size - 1

    def describe(self) -> str:
        c = self.grid.coord(self.rank)
        return f"rank {self.rank} (pp={c.pp} dp={c.dp} tp={c.tp}) in {self.grid!r}"

    def expert_grad_scale(self) -> float:
        """What an expert gradient summed by the dispatcher over its
        expert-parallel peers' tokens is multiplied by before an *average*
        over the expert-data-parallel group, so that the result is the data
        (x context) average (1 / (dp cp)) of the experts' full gradient, as
        the dense parameters' average over the data x context group."""
        return self.edp_size / (self.dp_size * self.cp_size)


_STATE: ParallelState | None = None


# ---- the groups' intra-node transport ------------------------------------------------
def node_identity() -> str:
    """What ranks must share to share memory: the host (name and boot), the
    /dev/shm mount, and the network namespace, which is how the benchmarks'
    emulated nodes (benchmarks/netns.py) stand apart on one machine."""
    def read(path):
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return "?"

    def inode(path):
        try:
            st = os.stat(path)
            return f"{st.st_dev}:{st.st_ino}"
        except OSError:
            return "?"

    return "|".join([socket.gethostname(), read("/proc/sys/kernel/random/boot_id"),
                     inode("/dev/shm"), inode("/proc/self/ns/net")])


def _shm_ops(p2p: bool):
    """(attach, unlink, detach, attached) of the collectives or the p2p transport."""
    ops = torch.ops.mapp
    if p2p:
        return ops.shm_p2p_attach, ops.shm_p2p_unlink, ops.shm_p2p_detach, ops.shm_p2p_attached
    return ops.shm_attach, ops.shm_unlink, ops.shm_detach, ops.shm_attached


def enable_shared_memory(group: dist.ProcessGroup, *, p2p: bool = False) -> bool:
    """Moves this group's CPU collectives (all_reduce_sum_, all_gather,
    reduce_scatter_sum and the layers built on them) through one shared-memory
    segment when every member runs on this node; with ``p2p=True`` instead
    attaches the point-to-point transport the pipeline executor sends
    activations and gradients through (``torch.ops.mapp.shm_isend/shm_irecv``).
    A no-op returning False for a group of one, a group spanning nodes, a
    non-Gloo group (NCCL has its own intra-node transports), or
    ``MAPP_SHM_COLLECTIVES=0``; the point-to-point transport only with
    ``MAPP_SHM_P2P=1`` (opt-in: no measurable gain at the sizes measured, see
    docs/architecture.md). Collective: every member must call it. If any
    member cannot map the segment, every member stays on the backend and a
    warning says why."""
    if group is None or group.size() == 1 or os.environ.get("MAPP_SHM_COLLECTIVES", "1") == "0":
        return False
    if dist.get_backend(group) != "gloo" or (p2p and os.environ.get("MAPP_SHM_P2P", "0") != "1"):
        return False
    attach, unlink, detach, _ = _shm_ops(p2p)
    idents: list = [None] * group.size()
    dist.all_gather_object(idents, node_identity(), group=group)
    if len(set(idents)) != 1:
        return False
    name, err = None, None
    if group.rank() == 0:
        name = f"/mapp-{'p2p-' if p2p else ''}{os.getpid()}-{secrets.token_hex(6)}"
        try:
            attach(group.group_name, name, True)
        except RuntimeError as e:
            name, err = None, str(e)
    box = [name, err]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    name, err = box
    if name is not None and group.rank() != 0:
        try:
            attach(group.group_name, name, False)
        except RuntimeError as e:
            err = str(e)
    errs: list = [None] * group.size()
    dist.all_gather_object(errs, err, group=group)  # every member has opened (or failed)
    if group.rank() == 0 and name is not None:
        unlink(group.group_name)
    failed = [e for e in errs if e]
    if failed:
        detach(group.group_name)
        what = "send/recv" if p2p else "collectives"
        warnings.warn(f"shared-memory {what} unavailable on group {group.group_name} "
                      f"({failed[0]}); using the Gloo backend", stacklevel=2)
        return False
    return True


def disable_shared_memory(group: dist.ProcessGroup) -> None:
    """Sends this group's collectives and send/recv back to its backend (not
    collective)."""
    if group is not None:
        for p2p in (False, True):
            _shm_ops(p2p)[2](group.group_name)


def shared_memory_enabled(group: dist.ProcessGroup, *, p2p: bool = False) -> bool:
    return group is not None and bool(_shm_ops(p2p)[3](group.group_name))


def new_groups(partition: list, rank: int, backend=None):
    """Creates every group of `partition` (a list of rank lists covering the
    world; collectively, same order on all ranks) and returns the one
    containing `rank` with its member list."""
    mine, members = None, None
    for ranks in partition:
        group = dist.new_group(ranks=ranks, backend=backend)
        if rank in ranks:
            mine, members = group, ranks
    return mine, members


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    *,
    backend: str | None = None,
    expert_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
) -> ParallelState:
    """Builds the (tp, pp, dp) grid over the default process group and creates
    its groups. Call after ``torch.distributed.init_process_group``; every rank
    must call it with the same arguments. dp is inferred as
    ``world_size / (tp * pp)``. ``expert_model_parallel_size`` (ep) shards
    MoE experts over ep data-parallel ranks (Megatron-Core's layout: ep
    divides dp; the expert groups come from ``RankGrid.expert_groups``).
    ``expert_tensor_parallel_size`` (etp, default tp) splits each expert's
    weights over etp tensor ranks; with etp < tp the other tensor ranks route
    their own slices of the tokens and join the expert grid (ep then divides
    ``tp / etp * cp * dp``).

    Returns the new :class:`ParallelState` (also installed as the default that
    the ``get_*`` functions of this module read).
    """
    global _STATE
    if _STATE is not None:
        raise RuntimeError(
            "model parallel state is already initialized; call "
            "megatronapp.destroy_model_parallel() before initializing it again"
        )
    _STATE = create_parallel_state(tensor_model_parallel_size, pipeline_model_parallel_size,
                                   virtual_pipeline_model_parallel_size, backend=backend,
                                   expert_model_parallel_size=expert_model_parallel_size,
                                   context_parallel_size=context_parallel_size,
                                   expert_tensor_parallel_size=expert_tensor_parallel_size)
    return _STATE


def create_parallel_state(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    *,
    backend: str | None = None,
    expert_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
) -> ParallelState:
    """Like :func:`initialize_model_parallel` but installs nothing: the
    returned value is passed explicitly (``parallel_state=``)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel() needs torch.distributed: call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first "
            "(torchrun sets the rendezvous environment)"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    grid = RankGrid(world, tp=tensor_model_parallel_size, pp=pipeline_model_parallel_size,
                    cp=context_parallel_size, ep=expert_model_parallel_size,
                    etp=expert_tensor_parallel_size or 0)
    if virtual_pipeline_model_parallel_size is not None:
        if virtual_pipeline_model_parallel_size < 1:
            raise ValueError(
                "virtual_pipeline_model_parallel_size must be >= 1 or None, got "
                f"{virtual_pipeline_model_parallel_size}"
            )
        if pipeline_model_parallel_size == 1 and virtual_pipeline_model_parallel_size > 1:
            raise ValueError(
                "virtual pipeline stages (virtual_pipeline_model_parallel_size="
                f"{virtual_pipeline_model_parallel_size}) need pipeline_model_parallel_size > 1"
            )
    tp_group, tp_ranks = new_groups(grid.groups(["tp"]), rank, backend)
    dp_group, dp_ranks = new_groups(grid.groups(["dp"]), rank, backend)
    pp_group, pp_ranks = new_groups(grid.groups(["pp"]), rank, backend)
    mp_group, mp_ranks = new_groups(grid.groups(["tp", "pp"]), rank, backend)
    emb_group, emb_ranks = None, None
    seen = set()
    for r in range(world):  # embedding groups: first and last stage per (tp, dp)
        ranks = tuple(grid.embedding_group(r))
        if ranks in seen:
            continue
        seen.add(ranks)
        g = dist.new_group(ranks=list(ranks), backend=backend)
        if rank in ranks:
            emb_group, emb_ranks = g, list(ranks)
    cp_group = dpcp_group = None
    cp_ranks = [rank]
    if grid.cp > 1:
        cp_group, cp_ranks = new_groups(grid.groups(["cp"]), rank, backend)
        dpcp_group, _ = new_groups(grid.groups(["cp", "dp"]), rank, backend)
    ep_group = edp_group = None
    ep_ranks, edp_ranks = [rank], dp_ranks
    if grid.ep > 1 or grid.etp != grid.tp:
        ep_group, ep_ranks = new_groups(grid.expert_groups(), rank, backend)
        edp_group, edp_ranks = new_groups(grid.expert_data_groups(), rank, backend)
    etp_group, etp_ranks = (tp_group, tp_ranks) if grid.etp == grid.tp else (None, [rank])
    etok_group, etok_ranks = None, [rank]
    if grid.etp != grid.tp:
        if grid.etp > 1:
            etp_group, etp_ranks = new_groups(grid.expert_tensor_groups(), rank, backend)
        etok_group, etok_ranks = new_groups(grid.expert_token_groups(), rank, backend)
    # On one node our collectives on these groups (tensor-parallel activations,
    # data-parallel buckets, norms, tied embeddings) move through shared memory.
    for g in (tp_group, dp_group, mp_group, emb_group, ep_group, edp_group, cp_group,
              dpcp_group):
        enable_shared_memory(g)
    for g in (etp_group, etok_group):
        if g is not tp_group:
            enable_shared_memory(g)
    # ... and, with MAPP_SHM_P2P=1, the pipeline's activations and gradients.
    enable_shared_memory(pp_group, p2p=True)
    return ParallelState(
        grid=grid,
        rank=rank,
        tensor_group=tp_group,
        data_group=dp_group,
        pipeline_group=pp_group,
        model_group=mp_group,
        embedding_group=emb_group,
        virtual_pipeline_size=virtual_pipeline_model_parallel_size,
        virtual_pipeline_rank=0 if virtual_pipeline_model_parallel_size else None,
        group_ranks={"tp": tp_ranks, "dp": dp_ranks, "pp": pp_ranks, "mp": mp_ranks,
                     "embedding": emb_ranks, "ep": ep_ranks, "edp": edp_ranks, "cp": cp_ranks,
                     "etp": etp_ranks, "etok": etok_ranks},
        expert_group=ep_group,
        expert_data_group=edp_group,
        expert_tensor_group=etp_group,
        expert_token_group=etok_group,
        context_group=cp_group,
        data_context_group=dpcp_group,
    )


def destroy_model_parallel() -> None:
    """Forgets the default state and destroys its process groups."""
    global _STATE
    if _STATE is None:
        return
    groups = {_STATE.tensor_group, _STATE.data_group, _STATE.pipeline_group,
              _STATE.model_group, _STATE.embedding_group, _STATE.expert_group,
              _STATE.expert_data_group, _STATE.context_group, _STATE.data_context_group,
              _STATE.expert_tensor_group, _STATE.expert_token_group}
    for g in groups:
        if g is not None and dist.is_initialized():
            disable_shared_memory(g)
            dist.destroy_process_group(g)
    _STATE = None


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def get_parallel_state() -> ParallelState:
    """The default state; raises a RuntimeError that says what to call if unset."""
    if _STATE is None:
        raise RuntimeError(
            "megatronapp model parallel state is not initialized: call "
            "torch.distributed.init_process_group(...) and then "
            "megatronapp.initialize_model_parallel(tensor_model_parallel_size=..., "
            "pipeline_model_parallel_size=...) before building parallel layers"
        )
    return _STATE


# ---- Megatron-compatible façade ------------------------------------------------

def resolve_state(parallel_state: ParallelState | None) -> ParallelState:
    """`parallel_state` if given, else the installed default."""
    return parallel_state if parallel_state is not None else get_parallel_state()


def get_tensor_model_parallel_group():
    return get_parallel_state().tensor_group


def get_pipeline_model_parallel_group():
    return get_parallel_state().pipeline_group


def get_data_parallel_group():
    return get_parallel_state().data_group


def get_model_parallel_group():
    return get_parallel_state().model_group


def get_embedding_group():
    return get_parallel_state().embedding_group


def get_context_parallel_group():
    """The ranks splitting one sequence with this one; None when cp == 1."""
    return get_parallel_state().context_group


def get_context_parallel_rank() -> int:
    return get_parallel_state().cp_rank


def get_context_parallel_world_size() -> int:
    return get_parallel_state().cp_size


def get_expert_model_parallel_group():
    """The ranks sharding the experts with this one; None when ep == 1."""
    return get_parallel_state().expert_group


def get_expert_data_parallel_group():
    """The ranks holding this rank's experts (the data group when ep == 1)."""
    return get_parallel_state().expert_data_group_or_data()


def get_expert_model_parallel_rank() -> int:
    return get_parallel_state().ep_rank


def get_expert_model_parallel_world_size() -> int:
    return get_parallel_state().ep_size


def get_expert_data_parallel_rank() -> int:
    return get_parallel_state().edp_rank


def get_expert_data_parallel_world_size() -> int:
    return get_parallel_state().edp_size


def get_tensor_model_parallel_rank() -> int:
    return get_parallel_state().tp_rank


def get_pipeline_model_parallel_rank() -> int:
    return get_parallel_state().pp_rank


def get_data_parallel_rank() -> int:
    return get_parallel_state().dp_rank


def get_tensor_model_parallel_world_size() -> int:
    return get_parallel_state().tp_size


def get_pipeline_model_parallel_world_size() -> int:
    return get_parallel_state().pp_size


def get_data_parallel_world_size() -> int:
    return get_parallel_state().dp_size


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 in this rank's tensor group."""
    return get_parallel_state().group_ranks["tp"][0]


def get_data_parallel_src_rank() -> int:
    return get_parallel_state().group_ranks["dp"][0]


def get_pipeline_model_parallel_first_rank() -> int:
    return get_parallel_state().group_ranks["pp"][0]


def get_pipeline_model_parallel_last_rank() -> int:
    return get_parallel_state().group_ranks["pp"][-1]


def get_pipeline_model_parallel_next_rank() -> int:
    s = get_parallel_state()
    ranks = s.group_ranks["pp"]
    return ranks[(s.pp_rank + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    s = get_parallel_state()
    ranks = s.group_ranks["pp"]
    return ranks[(s.pp_rank - 1) % len(ranks)]


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return get_parallel_state().virtual_pipeline_size


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    return get_parallel_state().virtual_pipeline_rank


def set_virtual_pipeline_model_parallel_rank(rank: int) -> None:
    get_parallel_state().virtual_pipeline_rank = rank


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    return get_parallel_state().is_pipeline_first_stage(ignore_virtual)


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    return get_parallel_state().is_pipeline_last_stage(ignore_virtual)


def get_expert_tensor_parallel_group():
    """The ranks holding the other shards of this rank's experts (None when etp == 1)."""
    return get_parallel_state().expert_tensor_group


def get_expert_tensor_parallel_rank() -> int:
    return get_parallel_state().etp_rank


def get_expert_tensor_parallel_world_size() -> int:
    return get_parallel_state().etp_size
