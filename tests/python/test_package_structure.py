"""The package's import graph: no cycles, calls go down only, and no module
reads another module's private names (static analysis of the sources)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "python" / "megatronapp"
#: Package-private modules meant to be shared inside the package.
SHARED_PRIVATE = {"megatronapp._C", "megatronapp._collectives", "megatronapp._moved"}


def _modules() -> dict:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(module: str, is_pkg: bool, level: int, target: str | None) -> str:
    base = module.split(".")
    if level:
        base = base[: len(base) - level + (1 if is_pkg else 0)]
    return ".".join(base + ([target] if target else []))


def _imports(module: str) -> list:
    """(imported module, imported name or None, line) of every import."""
    path = MODULES[module]
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names
                    if a.name.startswith("megatronapp")]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and not (node.module or "").startswith("megatronapp"):
                continue
            src = _resolve(module, is_pkg, node.level, node.module) if node.level else node.module
            for a in node.names:
                sub = f"{src}.{a.name}"
                if sub in MODULES or sub in SHARED_PRIVATE:
                    out.append((sub, None, node.lineno))  # a submodule
                else:
                    out.append((src, a.name, node.lineno))
    return out


def _ancestors(module: str) -> list:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]  # the root excluded


def _graph() -> dict:
    """module -> modules its import statements run (function-level imports
    included). Importing ``a.b.c`` first runs the packages ``a.b`` above it,
    unless the importer already lives inside them."""
    graph = {m: set() for m in MODULES}
    for m in MODULES:
        own = set(_ancestors(m)) | {m}
        for target, _name, _line in _imports(m):
            for t in [*_ancestors(target), target]:
                if t in MODULES and t not in own and t != "megatronapp":
                    graph[m].add(t)
    return graph


def _find_cycle(graph: dict):
    color, stack = {}, []

    def visit(n):
        color[n] = 1
        stack.append(n)
        for d in sorted(graph[n]):
            if color.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in color:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        color[n] = 2
        return None

    for n in sorted(graph):
        if n not in color:
            found = visit(n)
            if found:
                return found
    return None


def depth(graph: dict) -> int:
    """Longest import chain (modules on it), the package root excluded."""
    memo = {}

    def d(n):
        if n not in memo:
            memo[n] = 1 + max((d(x) for x in graph[n]), default=0)
        return memo[n]

    return max(d(n) for n in graph if n != "megatronapp")


def test_no_import_cycles():
    graph = _graph()
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    # 13: a second model family (models -> vit -> gpt's shared layers) added one level;
    # 14: a model composed of two others (models -> vlm -> vit -> gpt) one more;
    # 15: the scale model reads a training command line (scale_model -> pretrain), a
    # tool on top of the training edge that nothing in the package imports
    assert depth(graph) <= 15, f"import graph depth {depth(graph)}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_of_other_modules(module):
    bad = []
    for target, name, line in _imports(module):
        if target == module:
            continue
        if name is not None and name.startswith("_"):
            bad.append(f"line {line}: from {target} import {name}")
        elif name is None and target.rsplit(".", 1)[-1].startswith("_") \
                and target not in SHARED_PRIVATE:
            bad.append(f"line {line}: imports private module {target}")
    assert not bad, f"{module} reads private names of other modules: {bad}"


def test_layers_call_down_only():
    """The low layers never import the training edge or the executor's users."""
    graph = _graph()

    def reaches(a, b, seen=None):
        seen = seen or set()
        if a == b:
            return True
        seen.add(a)
        return any(reaches(x, b, seen) for x in graph[a] if x not in seen)

    for low in ("megatronapp.pipeline.executor", "megatronapp.distributed.data_parallel",
                "megatronapp.optimizer", "megatronapp.checkpoint", "megatronapp.models.gpt",
                "megatronapp.tensor_parallel.layers", "megatronapp.autograd"):
        assert not reaches(low, "megatronapp.training"), f"{low} imports the training edge"
    assert not reaches("megatronapp.pipeline.executor", "megatronapp.distributed.data_parallel")
    assert not reaches("megatronapp.distributed.data_parallel", "megatronapp.pipeline")


# ---- one engine (issue 44): each listed algorithm has one implementation ------------------
SRC = ROOT.parents[1] / "src"

#: algorithm -> (the one C++ file that implements it, markers of an implementation)
ONE_ENGINE = {
    "checkpoint file engine": (
        "src/torch/checkpoint_engine.cc",
        # CRC tables, positioned reads of tensor files, safetensors headers, the
        # commit's temporary directory and `latest` pointer
        ("0xEDB88320", "zlib.crc32", "os.pread", "pread(", "safe_open", 'unpack("<Q"',
         ".latest.tmp", "data_offsets",
         # the save's rendezvous and its background writer (async save)
         "_StoreRendezvous", "mapp-ckpt-writer", "wait_all(\"written\")"),
    ),
    "global gradient norm and clipping": (
        "src/torch/ddp.cc",
        ("_foreach_norm", "norm + 1e-6"),
    ),
    "tensor-parallel mappings and the vocabulary-parallel cross-entropy": (
        "src/torch/nn.cc",
        # the autograd functions (conjugate collectives; the CE's forward/backward)
        ("CopyToTP", "ReduceFromTP", "ReduceScatterTo", "GatherFrom", "ScatterTo",
         "VocabParallelCE", "_CopyToRegion", "_ReduceFromRegion", "_GatherFromRegion",
         "_ScatterToRegion", "_ReduceScatterToRegion", "_VocabParallelCrossEntropy"),
    ),
    "gradient reducer (buckets, readiness hooks, overlapped codec reductions, ZeRO-1 gathers)": (
        "src/torch/ddp.cc",
        # readiness hooks, the end-of-backward finish, submitting bucket reductions
        ("register_post_accumulate_grad_hook", "queue_callback", "set_post_acc_grad_hooks",
         "add_post_hook", ".mapp.compressed_reduce_scatter_async", ".mapp.param_all_gather_async",
         "_launch_ready"),
    ),
    "gradient finishing sums (sequence-parallel partial sums, tied embeddings)": (
        "src/torch/ddp.cc",
        ("embedding[0].add_(embedding[1])", "shared[0].add_(shared[1])", "flat_all_reduce"),
    ),
    "coalesced all-reduce of a list of tensors": (
        "src/torch/collectives.cc",
        ("_flatten_dense_tensors", "COALESCE_BUCKET_BYTES", "bytes < kCoalesceBucketBytes"),
    ),
    "ZeRO-1 layout (pieces of each rank's chunk, the parameter all-gather)": (
        "src/torch/ddp.cc",
        ("param_data.numel() // ", "lo - s_lo", "param_data.numel() / torch_ext::group_size"),
    ),
    "optimizer main parameters (fp32 copies of the pieces, their gradient views, write-back)": (
        "src/torch/ddp.cc",
        ("detach().float().clone()", "copy_(pc.main)", "to(at::kFloat).clone()",
         "shard_lo + pc.hi - pc.lo"),
    ),
    "loss scaler (fp16: hysteresis, backoff, growth)": (
        "src/torch/ddp.cc",
        ("_hysteresis_tracker", "scale * self.backoff_factor", "--hysteresis_tracker_"),
    ),
    "pipeline executor (tagged P2P, hand-offs between chunks, final backwards, delayed sends)": (
        "src/torch/pipeline.cc",
        # posting / waiting on a transfer by key, the chunks' last backwards,
        # the wave placement's hand-offs, the link-delay fault's timer send
        ("wait_recv", "post_recv", "final_backwards", "DelayedSend", "local_out[",
         "peak_activations = max("),
    ),
    "adaptive re-planning (measured stage times, link probes, one all-reduce)": (
        "src/torch/pipeline.cc",
        ("_probe_links", "self._stage[stage] +=", "Policy::kAdaptive, limit, costs"),
    ),
    "fault-injection variables parsed (MAPP_INJECT_SLOWDOWN, MAPP_INJECT_LINK_DELAY)": (
        "src/torch/faults.cc",
        ('"MAPP_INJECT_SLOWDOWN", {', '"MAPP_INJECT_LINK_DELAY", {', "SLOWDOWN: factor must be",
         "ms must be >= 0"),
    ),
    "deferred weight gradients (the zero-bubble linear and its store)": (
        "src/torch/nn.cc",
        # the active store, the store's entries, a linear autograd function of its own
        ("active_store", "class _Linear", "store.items", ".deferred.add(",
         "items_.emplace_back"),
    ),
}


@pytest.mark.parametrize("algorithm", sorted(ONE_ENGINE))
def test_each_engine_algorithm_is_written_once(algorithm):
    """A second implementation of an engine algorithm (in Python, or in
    another C++ file) fails here: extend the engine instead."""
    home, markers = ONE_ENGINE[algorithm]
    files = [*ROOT.rglob("*.py"), *SRC.rglob("*.cc"), *SRC.rglob("*.cu"),
             *(ROOT.parents[1] / "include").rglob("*.h")]
    found = {}
    for path in files:
        rel = str(path.relative_to(ROOT.parents[1]))
        if rel == home:
            continue
        text = path.read_text()
        hits = [m for m in markers if m in text]
        if hits:
            found[rel] = hits
    assert not found, (f"{algorithm} is implemented in {home}; these files carry a second "
                       f"implementation: {found}")
    home_text = (ROOT.parents[1] / home).read_text()
    assert any(m in home_text for m in markers), f"{home} no longer implements {algorithm}"


# ---- the 2026-12 regroup: old paths are deprecated aliases ---------------------------------
_ALIASES = """
import importlib, sys, warnings
import megatronapp
from megatronapp import _moved
for old, new in _moved.MOVED.items():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(new) is sys.modules[old], old
    assert any(issubclass(x.category, DeprecationWarning) and new in str(x.message)
               for x in w), (old, [str(x.message) for x in w])
    leaf = old.rsplit(".", 1)[1]
    assert getattr(megatronapp, leaf) is mod, old
print("ok")
"""
_PACKAGE_ONLY = """
import warnings
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    import megatronapp, megatronapp.training, megatronapp.pretrain, megatronapp.scope
    import megatronapp.checkpoint, megatronapp.convert, megatronapp.memory.plan
moved = [str(x.message) for x in w if "the old import path is deprecated" in str(x.message)]
assert not moved, moved
print("ok")
"""


def test_old_import_paths_are_the_moved_modules_with_a_warning():
    """Every module the regroup moved still imports from its old path, as the
    very module object it moved to (so patching one patches both), with a
    DeprecationWarning naming the new path; importing megatronapp itself
    warns about none of them."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _PACKAGE_ONLY], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
    p = subprocess.run([sys.executable, "-c", _ALIASES], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
    moved = sorted(m for m in MODULES if m.count(".") == 1 and m.split(".")[1] in {
        "data_parallel", "comm", "distributed_backend", "grad_scaler", "gradients", "muon",
        "faults", "watchdog", "scale_model", "fusions", "context_parallel", "scope_taps"})
    for m in moved:  # the stubs hold nothing but the alias
        assert "_alias(__name__" in MODULES[m].read_text(), m
