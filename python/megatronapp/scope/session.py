"""Generation with the scope, and the command loop every rank runs.

Rank 0 takes requests (from the web server, or from Python) and broadcasts
each one; every rank executes it (the model is tensor-parallel, so every
rank takes part in each forward); rank 0 returns the JSON-ready result.
"""

from __future__ import annotations

import math

import torch.distributed as dist

import torch

from . import Probe, Scope, ScopeError, reduce_tensor

__all__ = ["generate", "Session", "describe", "pca_2d", "to_json", "to_packed"]

MAX_NEW_TOKENS = 256
MAX_PROMPT_CHARS = 4096


def _full_logits(model, ids: torch.Tensor, state) -> torch.Tensor:
    """[b, s, V] logits of the whole vocabulary (gathered over the tensor group)."""
    from ..tensor_parallel import mappings

    logits = model(ids)  # [b, s, V/tp]
    if state.tp_size > 1:
        logits = mappings.gather_from_tensor_model_parallel_region(logits, state.tensor_group)
    return logits.float()


@torch.no_grad()
def generate(model, scope: Scope, prompt_ids: list, max_new_tokens: int, *, mode: str = "slow",
             top_k: int = 5, sample: bool = False, temperature: float = 1.0, seed: int = 0,
             vocab: int | None = None) -> dict:
    """Greedy (or top-k sampled) generation; every rank calls it with the
    same arguments. ``slow``: token by token, the scope captures every
    forward and each step reports the chosen token's probability and its
    ``top_k`` alternatives. ``fast``: the prompts run as one batch and the
    scope captures only the last forward. Returns {"tokens", "steps",
    "internals"} on rank 0 (internals of the last forward)."""
    if mode not in ("slow", "fast"):
        raise ScopeError(f"mode {mode!r}: expected slow or fast")
    if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
        raise ScopeError("empty prompt: give at least one token")
    if len({len(p) for p in prompt_ids}) != 1:
        raise ScopeError("fast mode batches prompts of equal length; got lengths "
                         f"{sorted({len(p) for p in prompt_ids})}")
    cfg = scope.model_config
    limit = cfg.seq_length - len(prompt_ids[0])
    if max_new_tokens < 1 or max_new_tokens > min(MAX_NEW_TOKENS, limit):
        raise ScopeError(f"max_new_tokens must be in [1, {min(MAX_NEW_TOKENS, limit)}] (the "
                         f"model's seq_length is {cfg.seq_length}, the prompt has "
                         f"{len(prompt_ids[0])} tokens), got {max_new_tokens}")
    vocab = vocab or cfg.vocab_size
    ids = torch.tensor(prompt_ids, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    steps = [[] for _ in prompt_ids]
    internals = None
    for t in range(max_new_tokens):
        last = t == max_new_tokens - 1
        if mode == "slow" or last:
            with scope.step():
                logits = _full_logits(model, ids, scope.state)
            internals = scope.collect()
        else:
            logits = _full_logits(model, ids, scope.state)
        probs = torch.softmax(logits[:, -1, :vocab] / max(temperature, 1e-6), dim=-1)
        top_p, top_i = probs.topk(min(top_k, vocab), dim=-1)
        if sample:
            pick = torch.multinomial(top_p / top_p.sum(-1, keepdim=True), 1, generator=g)
            nxt = top_i.gather(1, pick).squeeze(1)
        else:
            nxt = top_i[:, 0]
        for b in range(len(prompt_ids)):
            if mode == "slow" or last:
                steps[b].append({"token": int(nxt[b]), "prob": float(probs[b, nxt[b]]),
                                 "topk": [[int(i), float(p)] for p, i in
                                          zip(top_p[b], top_i[b], strict=True)]})
        ids = torch.cat([ids, nxt[:, None]], dim=1)
    return {"tokens": ids.tolist(), "steps": steps, "internals": internals}


def pca_2d(x: torch.Tensor) -> list:
    """Rows of x [n, h] projected on their first two principal components."""
    x = x.double()
    x = x - x.mean(0, keepdim=True)
    if x.shape[0] < 2:
        return [[0.0, 0.0] for _ in range(x.shape[0])]
    _, _, vh = torch.linalg.svd(x, full_matrices=False)
    proj = x @ vh[:2].T
    if proj.shape[1] < 2:
        proj = torch.cat([proj, torch.zeros(proj.shape[0], 1, dtype=proj.dtype)], 1)
    return proj.tolist()


def _finite(x):
    if isinstance(x, list):
        return [_finite(y) for y in x]
    return x if math.isfinite(x) else None


def to_packed(v):
    """Like :func:`to_json` but each tensor as {"dtype": "float32" | "int64",
    "shape", "data": base64 of its little-endian bytes}: what the training
    stream sends (a fraction of the encoding cost of nested lists)."""
    import base64

    if torch.is_tensor(v):
        t = v.detach().cpu().contiguous()
        t = t.float() if t.is_floating_point() else t.long()
        return {"dtype": "float32" if t.is_floating_point() else "int64",
                "shape": list(t.shape), "data": base64.b64encode(t.numpy().tobytes()).decode()}
    if isinstance(v, dict):
        return {str(k): to_packed(x) for k, x in v.items()}
    return v


def to_json(v):
    """Tensors (and dicts/lists of them) as nested lists; non-finite values
    (a bit flip can make them) become None."""
    if torch.is_tensor(v):
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            return _finite(v.tolist())
        return v.tolist()
    if isinstance(v, dict):
        return {str(k): to_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [to_json(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def describe(scope: Scope, world: int, mode: str) -> dict:
    """What ``info`` returns: the model, the layout, what can be asked."""
    from . import KINDS, PERTURB_SITES, REDUCERS, SITES

    c = scope.model_config
    st = scope.state
    return {"mode": mode, "step": scope.step_count,
            "model": {"num_layers": c.num_layers, "hidden_size": c.hidden_size,
                      "num_attention_heads": c.num_attention_heads,
                      "seq_length": c.seq_length, "vocab_size": c.vocab_size},
            "parallel": {"tp": st.tp_size, "pp": st.pp_size, "dp": st.dp_size, "world": world},
            "sites": list(SITES), "perturb_sites": list(PERTURB_SITES),
            "reducers": list(REDUCERS), "kinds": list(KINDS),
            "watching": sorted(scope.probes),
            "perturbations": [p.describe() for p in scope.perturbations],
            "log": scope.log[-50:]}


class Session:
    """A model, its scope and tokenizer, driven by commands that rank 0
    broadcasts (:meth:`execute` on every rank, :meth:`serve_forever` on the
    others)."""

    def __init__(self, model, tokenizer, parallel_state=None):
        self.model = model.eval()
        self.scope = Scope(model, parallel_state)
        self.tokenizer = tokenizer
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def info(self) -> dict:
        return describe(self.scope, self.world, "serve")

    # ---- commands ---------------------------------------------------------
    def execute(self, cmd: dict) -> dict:
        """Runs one (validated) command on this rank; the result matters on rank 0."""
        op = cmd.get("op")
        if op == "info":
            return self.info()
        if op == "generate":
            return self._generate(cmd)
        if op == "perturb":
            args = {k: cmd[k] for k in ("layers", "std", "scale", "bit", "fraction", "head",
                                        "name", "steps", "seed") if k in cmd}
            pid = self.scope.perturb(cmd["site"], cmd["kind"], **args)
            return {"id": pid, "perturbations": [p.describe() for p in self.scope.perturbations]}
        if op == "clear":
            self.scope.clear_perturbations()
            return {"perturbations": []}
        if op == "noop":
            return {}
        if op in ("watch", "unwatch"):
            raise ScopeError(f"{op} applies to a training run (--scope-port); a generation "
                             "records every site")
        raise ScopeError(f"unknown op {op!r}: expected info, generate, perturb or clear")

    def _generate(self, cmd: dict) -> dict:
        prompts = cmd["prompts"]
        ids = [self.tokenizer.tokenize(p) for p in prompts]
        sc = self.scope
        sc.unwatch()
        sc.watch("attn_probs", reduce="none")
        sc.watch("mlp_out", reduce="none")
        bins = cmd.get("bins", 64)
        for site in ("query", "key", "value", "attn_context", "residual", "mlp_in"):
            sc.watch(site, reduce="bins", bins=bins)
        out = generate(self.model, sc, ids, cmd.get("max_new_tokens", 8),
                       mode=cmd.get("mode", "slow"),
                       top_k=cmd.get("top_k", 5), sample=cmd.get("sample", False),
                       temperature=cmd.get("temperature", 1.0), seed=cmd.get("seed", 0),
                       vocab=getattr(self.tokenizer, "vocab_size", None))
        if self.rank != 0:
            return {}
        internals = out["internals"]
        mlp = internals.pop("mlp_out", {})
        pca = {str(layer): pca_2d(v) for layer, v in mlp.items()}
        binned = Probe("mlp_out", reduce="bins", bins=bins)
        internals["mlp_out"] = {layer: reduce_tensor(v, binned) for layer, v in mlp.items()}
        detok = self._token_text
        return {"tokens": out["tokens"],
                "text": [self.tokenizer.detokenize(t) for t in out["tokens"]],
                "token_text": [[detok(i) for i in t] for t in out["tokens"]],
                "steps": [[{**s, "text": detok(s["token"]),
                            "topk": [[i, p, detok(i)] for i, p in s["topk"]]} for s in st]
                          for st in out["steps"]],
                "internals": to_json(internals), "pca": pca,
                "perturbed": self.scope.perturbed_last_step()}

    def _token_text(self, i: int) -> str:
        try:
            return self.tokenizer.detokenize([i])
        except Exception:  # noqa: BLE001 - a padding id outside the tokenizer
            return f"<{i}>"

    # ---- the loop ---------------------------------------------------------
    def broadcast(self, cmd: dict | None) -> dict | None:
        """Rank 0 sends `cmd`; every rank returns it (collective)."""
        if self.world == 1:
            return cmd
        box = [cmd]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def run(self, cmd: dict) -> dict:
        """Rank 0: broadcast `cmd`, execute it everywhere, return rank 0's
        result (or {"error"}: a bad request never stops the session)."""
        cmd = self.broadcast(cmd)
        return self.execute_safely(cmd)

    def execute_safely(self, cmd: dict) -> dict:
        try:
            return self.execute(cmd)
        except (ScopeError, KeyError, TypeError) as e:
            what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            return {"error": what}

    def serve_forever(self) -> None:
        """Ranks other than 0: execute what rank 0 broadcasts until it says stop."""
        while True:
            cmd = self.broadcast(None)
            if cmd is None or cmd.get("op") == "stop":
                return
            self.execute_safely(cmd)
