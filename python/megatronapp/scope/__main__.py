"""``python -m megatronapp.scope serve --port 8080 [--checkpoint DIR]``

Serves a model for the MegaScope page. Launch it like training to shard the
model over tensor-parallel ranks::

    torchrun --nproc-per-node 2 -m megatronapp.scope serve --checkpoint runs/demo/ckpt \\
        --tensor-model-parallel-size 2

Rank 0 hosts the web server; every rank runs the model. Without
``--checkpoint`` the model is drawn from ``--seed`` with the shape flags.
To watch a training run instead, give ``--scope-port P`` to pretrain_gpt.py.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
from datetime import timedelta

import torch.distributed as dist

import torch


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatronapp.scope")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model to the MegaScope page")
    s.add_argument("--port", type=int, default=8080, help="0: any free port (printed)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--token", default=os.environ.get("MAPP_SCOPE_TOKEN"),
                   help="required when --host is not loopback")
    s.add_argument("--checkpoint", help="a checkpoint directory (its latest) or iter_* path")
    s.add_argument("--tensor-model-parallel-size", type=int, default=None,
                   help="default: the world size")
    s.add_argument("--tokenizer-type", default="ByteTokenizer")
    s.add_argument("--tokenizer-model", default=None)
    s.add_argument("--vocab-file", default=None)
    s.add_argument("--merge-file", default=None)
    s.add_argument("--num-layers", type=int, default=2)
    s.add_argument("--hidden-size", type=int, default=64)
    s.add_argument("--num-attention-heads", type=int, default=4)
    s.add_argument("--seq-length", type=int, default=128)
    s.add_argument("--seed", type=int, default=1234)
    # the block of a fresh model (Megatron-LM's flags; a checkpoint brings its own)
    s.add_argument("--ffn-hidden-size", type=int, default=None)
    s.add_argument("--normalization", default="LayerNorm", choices=("LayerNorm", "RMSNorm"))
    s.add_argument("--swiglu", action="store_true")
    s.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=("learned_absolute", "rope", "none"))
    s.add_argument("--rotary-base", type=int, default=10000)
    s.add_argument("--group-query-attention", action="store_true")
    s.add_argument("--num-query-groups", type=int, default=1)
    s.add_argument("--kv-channels", type=int, default=None)
    s.add_argument("--disable-bias-linear", action="store_true")
    s.add_argument("--add-qkv-bias", action="store_true")
    s.add_argument("--qk-layernorm", action="store_true")
    s.add_argument("--port-file", help="write the bound port here once listening")
    return p


def _model_config(args, tp: int, tokenizer_vocab: int):
    from ..data import padded_vocab_size
    from ..inference import checkpoint_model_config
    from ..models import GPTConfig

    if args.checkpoint:
        try:
            return checkpoint_model_config(args.checkpoint)
        except ValueError as e:
            raise SystemExit(f"--checkpoint {e}") from None
    try:
        cfg = GPTConfig(
            vocab_size=padded_vocab_size(tokenizer_vocab, tp, 128),
            hidden_size=args.hidden_size, num_layers=args.num_layers,
            num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
            ffn_hidden_size=args.ffn_hidden_size, normalization=args.normalization,
            swiglu=args.swiglu, position_embedding_type=args.position_embedding_type,
            rotary_base=float(args.rotary_base),
            num_query_groups=args.num_query_groups if args.group_query_attention else None,
            kv_channels=args.kv_channels, add_bias_linear=not args.disable_bias_linear,
            add_qkv_bias=args.add_qkv_bias, qk_layernorm=args.qk_layernorm)
    except ValueError as e:
        raise SystemExit(f"megatronapp.scope serve: {e}") from None
    return cfg, None


def serve(args) -> None:
    from .. import initialize_model_parallel
    from ..checkpoint import load
    from ..data import build_tokenizer
    from ..models import GPTModel
    from .server import ScopeServer
    from .session import Session

    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group("gloo", timeout=timedelta(hours=12))
        else:
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0,
                                    world_size=1)
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = args.tensor_model_parallel_size or world
    if world % tp:
        raise SystemExit(f"--tensor-model-parallel-size {tp} does not divide the world "
                         f"({world} ranks)")
    state = initialize_model_parallel(tensor_model_parallel_size=tp)
    tok = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file,
                          merge_file=args.merge_file, tokenizer_model=args.tokenizer_model)
    cfg, path = _model_config(args, tp, tok.vocab_size)
    model = GPTModel(cfg, parallel_state=state, seed=args.seed)
    if path is not None:
        load(path, [model], parallel_state=state)
    session = Session(model, tok, state)
    if rank != 0:
        session.serve_forever()
        return
    server = ScopeServer(args.host, args.port, args.token).start()
    print(f"[megatronapp] MegaScope serving http://{args.host}:{server.port}/ "
          f"({world} rank{'s' * (world > 1)}, tp {tp})", flush=True)
    server.write_port_file(args.port_file)
    try:
        while True:
            try:
                cmd, reply = server.requests.get(timeout=60)
            except queue.Empty:
                session.run({"op": "noop"})  # keeps the other ranks' broadcast alive
                continue
            reply(session.run(cmd))
    except KeyboardInterrupt:
        pass
    finally:
        session.broadcast({"op": "stop"})
        server.stop()


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    if args.command == "serve":
        serve(args)
    sys.exit(0)


if __name__ == "__main__":
    main()
