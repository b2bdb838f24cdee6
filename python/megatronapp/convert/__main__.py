"""``python -m megatronapp.convert`` (console script ``megatronapp-convert``):
Hugging Face checkpoints in and out; see :mod:`megatronapp.convert`."""

from __future__ import annotations

import argparse
import sys

from . import ConversionError, export_hf, import_hf


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatronapp-convert", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("import-hf", help="a Hugging Face model directory -> our checkpoint")
    i.add_argument("--hf-dir", required=True, help="config.json + safetensors (one file or "
                   "shards with model.safetensors.index.json)")
    i.add_argument("--output", required=True, help="checkpoint directory (--load it)")
    i.add_argument("--tensor-model-parallel-size", type=int, default=1)
    i.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    i.add_argument("--expert-model-parallel-size", type=int, default=1)
    i.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="the experts' tensor-parallel size (divides the tensor-parallel size; "
                   "default: the tensor-parallel size)")
    e = sub.add_parser("export-hf", help="our checkpoint -> a Hugging Face model directory")
    e.add_argument("--load", required=True, help="checkpoint directory (its latest) or iter_* path")
    e.add_argument("--output", required=True, help="Hugging Face model directory to write")
    e.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="auto: the stored dtype")
    e.add_argument("--max-shard-size-gb", type=float, default=2.0)
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "import-hf":
            path = import_hf(args.hf_dir, args.output,
                             tensor_model_parallel_size=args.tensor_model_parallel_size,
                             pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                             expert_model_parallel_size=args.expert_model_parallel_size,
                             expert_tensor_parallel_size=args.expert_tensor_parallel_size)
            print(f"[megatronapp] imported {args.hf_dir} -> {path}")
        else:
            out = export_hf(args.load, args.output, dtype=args.dtype,
                            max_shard_size=int(args.max_shard_size_gb * (1 << 30)))
            print(f"[megatronapp] exported {args.load} -> {out}")
    except ConversionError as e:
        sys.exit(f"megatronapp-convert {args.command}: {e}")


if __name__ == "__main__":
    main()
