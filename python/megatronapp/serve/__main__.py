"""``python -m megatronapp.serve --load DIR [--tensor-model-parallel-size N
--pipeline-model-parallel-size P] [--port 8000]``: see :mod:`megatronapp.serve`.

One process serves without a launcher; for N x P ranks launch it like
training (``torchrun --nproc-per-node N*P -m megatronapp.serve ...``).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch.distributed as dist

import torch


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatronapp.serve",
                                description="an OpenAI-style completion server for a checkpoint",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--load", required=True,
                   help="a checkpoint directory (its latest) or an iter_* path (any saving "
                        "layout: the weights are resharded)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="the layers split evenly over the stages")
    p.add_argument("--host", default="127.0.0.1", help="another address needs --token")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--port-file", help="write the bound port here once listening")
    p.add_argument("--token", default=os.environ.get("MAPP_SERVE_TOKEN"),
                   help="clients send 'Authorization: Bearer T' (default $MAPP_SERVE_TOKEN)")
    p.add_argument("--model-name", default=None,
                   help="the name clients give as \"model\" (default: the --load folder's)")
    p.add_argument("--seq-length", type=int, default=None,
                   help="the longest prompt + completion (default: the checkpoint's; 4096 for "
                        "a rotary checkpoint, which stores none; never past a learned position "
                        "table)")
    p.add_argument("--max-batch-size", type=int, default=16,
                   help="prompts generated together")
    p.add_argument("--batch-wait-ms", type=float, default=5.0,
                   help="once a prompt is queued, how long to wait for more to batch with it")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20)
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="serve in bfloat16")
    precision.add_argument("--fp16", action="store_true", help="serve in float16")
    p.add_argument("--tokenizer-type", default="ByteTokenizer")
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--vocab-file", default=None)
    p.add_argument("--merge-file", default=None)
    return p


def _init_distributed():
    """(device, whether this process started the process group)."""
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return device, False
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timedelta(hours=12))
    else:
        dist.init_process_group(backend, init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    return device, True


def serve(args) -> None:
    from .._http import LOOPBACK
    from ..data import build_tokenizer
    from ..inference import InferenceEngine, load_model
    from . import Driver
    from .http import CompletionServer

    if args.max_batch_size < 1:
        raise SystemExit(f"--max-batch-size {args.max_batch_size}: must be >= 1")
    if args.host not in LOOPBACK and not args.token:
        raise SystemExit(f"megatronapp.serve: --host {args.host} exposes the model beyond this "
                         "machine: give --token T (or $MAPP_SERVE_TOKEN)")
    device, started = _init_distributed()
    rank = dist.get_rank()
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    try:
        model, state = load_model(args.load, tp, pp, dtype=dtype, device=device,
                                  seq_length=args.seq_length)
        tok = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file,
                              merge_file=args.merge_file, tokenizer_model=args.tokenizer_model)
    except (ValueError, OSError) as e:
        raise SystemExit(f"megatronapp.serve: {e}") from None
    if tok.vocab_size > model.config.vocab_size:
        raise SystemExit(f"megatronapp.serve: the tokenizer has {tok.vocab_size} ids, the "
                         f"model's vocabulary {model.config.vocab_size} rows: use the tokenizer "
                         "the checkpoint was trained with")

    def stop_check(tokens, stop):
        text = tok.detokenize(tokens)
        return any(s in text for s in stop)
    engine = InferenceEngine(model, state, vocab=tok.vocab_size,
                             eod=getattr(tok, "eod", None), stop_check=stop_check)
    driver = Driver(engine, max_batch_size=args.max_batch_size,
                    batch_wait_s=args.batch_wait_ms / 1000)
    if rank != 0:
        driver.follow()
        return
    name = args.model_name or os.path.basename(os.path.normpath(args.load))
    try:
        server = CompletionServer(args.host, args.port, args.token, tokenizer=tok, model=name,
                                  seq_length=model.config.seq_length, vocab=tok.vocab_size,
                                  max_request_bytes=args.max_request_bytes).start()
    except (ValueError, OSError) as e:
        driver.stop()
        raise SystemExit(f"megatronapp.serve: {e}") from None
    world = dist.get_world_size()
    print(f"[megatronapp] serving {name!r} on http://{args.host}:{server.port}/v1/completions "
          f"({world} rank{'s' * (world > 1)}: tp {tp} x pp {pp})", flush=True)
    server.write_port_file(args.port_file)
    try:
        while True:
            driver.run_once(server.requests)
    except KeyboardInterrupt:
        pass
    finally:
        driver.stop()
        server.stop()


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    serve(args)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
