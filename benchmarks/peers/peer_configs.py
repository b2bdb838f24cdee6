"""The peers harness's configurations (run.py): every stack's layouts as
flags, the suites that group them, the pairs the report subtracts, and the
shared model flags; how a configuration's flags combine with the shared ones."""

from __future__ import annotations

# A flag the worker turns into an environment variable of that run (not a trainer flag).
ENV_FLAG = "--env="
# The c10d backend the launch's world is created on (not a trainer flag): "gloo"
# (default) or "mapp", megatronapp's shared-memory backend, which any stack can
# use (megatronapp.distributed.backend): the same transport for every stack.
BACKEND_FLAG = "--backend="
MAPP = BACKEND_FLAG + "mapp"
TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
PP4 = ["--pipeline-model-parallel-size", "4"]
# key -> (stack, label, flags, exact). Model / batch flags are shared (MODEL
# below). exact: the configuration computes the same update as every other
# exact one (no lossy compression), so its losses must agree step by step.
CONFIGS = {
    "torch-ddp": ("torch", "torch: DDP x4", [], True),
    "torch-fsdp2": ("torch", "torch: FSDP2 x4", ["--data-parallel", "fsdp2"], True),
    "torch-tp2-ddp": ("torch", "torch: DTensor TP2 x DDP2", TP2, True),
    "torch-powersgd": ("torch", "torch: DTensor TP2 x DDP2 + PowerSGD(4)", TP2 + [
        "--ddp-comm-hook", "powersgd", "--powersgd-rank", "4"], False),
    "torch-pp": ("torch", "torch: DTensor TP2 x pipelining PP2 (1F1B)", TP2 + PP2 + [
        "--pipeline-schedule", "1f1b"], True),
    "torch-zb": ("torch", "torch: DTensor TP2 x pipelining PP2 (zero-bubble)", TP2 + PP2 + [
        "--pipeline-schedule", "zero-bubble"], True),
    # PyTorch's own stacks on megatronapp's shared-memory backend (same transport as ours).
    "torch-ddp-mapp": ("torch", "torch: DDP x4, mapp backend", [MAPP], True),
    "torch-tp2-ddp-mapp": ("torch", "torch: DTensor TP2 x DDP2, mapp backend", TP2 + [MAPP], True),
    "torch-zb-mapp": ("torch", "torch: DTensor TP2 x pipelining PP2 (zero-bubble), mapp backend",
                      TP2 + PP2 + ["--pipeline-schedule", "zero-bubble", MAPP], True),
    "deepspeed-zero1": ("deepspeed", "DeepSpeed: ZeRO-1 x4", ["--zero-stage", "1"], True),
    "deepspeed-zero2": ("deepspeed", "DeepSpeed: ZeRO-2 x4", ["--zero-stage", "2"], True),
    "deepspeed-pp": ("deepspeed", "DeepSpeed: PipelineModule PP2 x DP2 (1F1B), ZeRO-1",
                     PP2 + ["--zero-stage", "1"], True),
    "megatron-tp2-dp2": ("megatron", "Megatron-Core: TP2 x DP2", TP2, True),
    "megatron-tp2-pp2": ("megatron", "Megatron-Core: TP2 x PP2 (1F1B)", TP2 + PP2, True),
    "megatron-tp2-pp2-vp": ("megatron", "Megatron-Core: TP2 x PP2 interleaved (v=2)",
                            TP2 + PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"], True),
    "megatron-pp4": ("megatron", "Megatron-Core: PP4 (1F1B)", PP4, True),
    # The same on megatronapp's shared-memory c10d backend (same transport as ours).
    "megatron-tp2-dp2-mapp": ("megatron", "Megatron-Core: TP2 x DP2, mapp backend", TP2 + [MAPP],
                              True),
    "megatron-tp2-pp2-mapp": ("megatron", "Megatron-Core: TP2 x PP2 (1F1B), mapp backend",
                              TP2 + PP2 + [MAPP], True),
    "megatron-tp2-pp2-vp-mapp": ("megatron", "Megatron-Core: TP2 x PP2 interleaved (v=2), mapp "
                                 "backend", TP2 + PP2 + [
                                     "--num-layers-per-virtual-pipeline-stage", "1", MAPP], True),
    "megatron-pp4-mapp": ("megatron", "Megatron-Core: PP4 (1F1B), mapp backend", PP4 + [MAPP],
                          True),
    "deepspeed-pp-mapp": ("deepspeed", "DeepSpeed: PipelineModule PP2 x DP2 (1F1B), ZeRO-1, mapp "
                          "backend", PP2 + ["--zero-stage", "1", MAPP], True),
    "deepspeed-pp-mapp-bf16": ("deepspeed", "DeepSpeed: PipelineModule PP2 x DP2 (1F1B), ZeRO-1, "
                               "bf16, mapp backend", PP2 + ["--zero-stage", "1", "--bf16", MAPP],
                               False),
    # Each at its best, the micro-batch size too (global batch 16 either way).
    "deepspeed-pp-mapp-mb2": ("deepspeed", "DeepSpeed: PipelineModule PP2 x DP2 (1F1B), ZeRO-1, "
                              "micro-batch 2, mapp backend",
                              PP2 + ["--zero-stage", "1", "--micro-batch-size", "2", MAPP], True),
    "deepspeed-pp-mapp-mb1": ("deepspeed", "DeepSpeed: PipelineModule PP2 x DP2 (1F1B), ZeRO-1, "
                              "micro-batch 1, mapp backend",
                              PP2 + ["--zero-stage", "1", "--micro-batch-size", "1", MAPP], True),
    "deepspeed-zero1-mapp": ("deepspeed", "DeepSpeed: ZeRO-1 x4, mapp backend",
                             ["--zero-stage", "1", MAPP], True),
    # Pure data parallelism: no pipeline bubble, the gradient reduction overlapped
    # with the backward.
    "ours-dp4": ("ours", "ours: DP4, pool", ["--memory-pool"], True),
    "ours-dp4-zero1": ("ours", "ours: DP4, ZeRO-1, pool", ["--use-distributed-optimizer",
                                                           "--memory-pool"], True),
    "ours-dp": ("ours", "ours: TP2 x DP2, int8 codec, pool", TP2 + [
        "--grad-compression", "int8", "--grad-compression-start-iter", "2", "--memory-pool"],
        False),
    "ours-dp-onebit": ("ours", "ours: TP2 x DP2, onebit:32 codec, pool", TP2 + [
        "--grad-compression", "onebit:32", "--grad-compression-start-iter", "2",
        "--memory-pool"], False),
    "ours-dp-zero1": ("ours", "ours: TP2 x DP2, int8 codec, ZeRO-1, pool", TP2 + [
        "--grad-compression", "int8", "--grad-compression-start-iter", "2",
        "--use-distributed-optimizer", "--memory-pool"], False),
    "ours-dp-exact": ("ours", "ours: TP2 x DP2, pool", TP2 + ["--memory-pool"], True),
    "ours-pp-1f1b": ("ours", "ours: TP2 x PP2 1F1B, pool", TP2 + PP2 + [
        "--pipeline-schedule", "1f1b", "--memory-pool"], True),
    # The same with each tensor rank sending half of every tensor between
    # stages (scatter/gather over the tensor group; half the link bytes).
    "ours-pp-1f1b-sg": ("ours", "ours: TP2 x PP2 1F1B, pool, scatter/gather between stages",
                        TP2 + PP2 + ["--pipeline-schedule", "1f1b", "--memory-pool",
                                     "--scatter-gather-tensors-in-pipeline"], True),
    # The same with the collectives and pipeline send/recv on Gloo, not shared
    # memory (the transport before 2026-12-02).
    "ours-pp-1f1b-gloo": ("ours", "ours: TP2 x PP2 1F1B, pool, all on Gloo",
                          TP2 + PP2 + ["--pipeline-schedule", "1f1b", "--memory-pool",
                                       ENV_FLAG + "MAPP_SHM_COLLECTIVES=0"], True),
    # Every group on the mapp backend (init_process_group("mapp")), as the peers' -mapp runs.
    "ours-pp-1f1b-mapp": ("ours", "ours: TP2 x PP2 1F1B, pool, mapp backend",
                          TP2 + PP2 + ["--pipeline-schedule", "1f1b", "--memory-pool", MAPP],
                          True),
    "ours-pp": ("ours", "ours: TP2 x PP2 zero-bubble, pool", TP2 + PP2 + [
        "--pipeline-schedule", "zero-bubble", "--memory-pool"], True),
    "ours-pp-dp": ("ours", "ours: PP2 x DP2 zero-bubble, pool", PP2 + [
        "--pipeline-schedule", "zero-bubble", "--memory-pool"], True),
    # DeepSpeed's best layout as it runs it: PP2 x DP2 with ZeRO-1.
    "ours-pp-dp-zero1": ("ours", "ours: PP2 x DP2 zero-bubble, ZeRO-1, pool", PP2 + [
        "--pipeline-schedule", "zero-bubble", "--use-distributed-optimizer", "--memory-pool"],
        True),
    # The same with the parameter all-gather overlapped with the next forward.
    "ours-pp-dp-zero1-opg": ("ours", "ours: PP2 x DP2 zero-bubble, ZeRO-1, overlapped param gather, "
                             "pool", PP2 + ["--pipeline-schedule", "zero-bubble",
                                            "--use-distributed-optimizer", "--overlap-param-gather",
                                            "--memory-pool"], True),
    # ZB-V: two chunks per stage in a V (stage 0 holds the first and last layers).
    "ours-pp-dp-zbv": ("ours", "ours: PP2 x DP2 ZB-V, pool", PP2 + [
        "--pipeline-schedule", "zb-v", "--memory-pool"], True),
    "ours-pp-zbv": ("ours", "ours: TP2 x PP2 ZB-V, pool", TP2 + PP2 + [
        "--pipeline-schedule", "zb-v", "--memory-pool"], True),
    "ours-pp-dp-int8": ("ours", "ours: PP2 x DP2 zero-bubble, int8 codec, pool", PP2 + [
        "--pipeline-schedule", "zero-bubble", "--grad-compression", "int8",
        "--grad-compression-start-iter", "2", "--memory-pool"], False),
    "ours-pp4-bf16": ("ours", "ours: PP4 zero-bubble, bf16, pool", PP4 + [
        "--pipeline-schedule", "zero-bubble", "--bf16", "--memory-pool"], False),
    "ours-pp-dp-bf16": ("ours", "ours: PP2 x DP2 zero-bubble, bf16, pool", PP2 + [
        "--pipeline-schedule", "zero-bubble", "--bf16", "--memory-pool"], False),
    "ours-pp4-1f1b": ("ours", "ours: PP4 1F1B, pool", PP4 + [
        "--pipeline-schedule", "1f1b", "--memory-pool"], True),
    "ours-pp4": ("ours", "ours: PP4 zero-bubble, pool", PP4 + [
        "--pipeline-schedule", "zero-bubble", "--memory-pool"], True),
    "ours-pp4-mb2": ("ours", "ours: PP4 zero-bubble, micro-batch 2, pool", PP4 + [
        "--pipeline-schedule", "zero-bubble", "--micro-batch-size", "2", "--memory-pool"], True),
    "ours-pp-dp-mb2": ("ours", "ours: PP2 x DP2 zero-bubble, micro-batch 2, pool", PP2 + [
        "--pipeline-schedule", "zero-bubble", "--micro-batch-size", "2", "--memory-pool"], True),
    # The same without gradient-accumulation fusion (weight gradients through a
    # temporary that autograd adds): that change's effect, measured each run.
    "ours-pp4-no-gaf": ("ours", "ours: PP4 zero-bubble, pool, no gradient-accumulation fusion",
                        PP4 + ["--pipeline-schedule", "zero-bubble", "--memory-pool",
                               "--no-gradient-accumulation-fusion"], True),
    # The same with the pipeline's send/recv through shared memory (opt-in,
    # MAPP_SHM_P2P=1): that transport's effect, measured each run.
    "ours-pp4-shm-p2p": ("ours", "ours: PP4 zero-bubble, pool, pipeline send/recv in shared memory",
                         PP4 + ["--pipeline-schedule", "zero-bubble", "--memory-pool",
                                ENV_FLAG + "MAPP_SHM_P2P=1"], True),
    "ours-pp-sp": ("ours", "ours: TP2 x PP2 zero-bubble, SP, pool", TP2 + PP2 + [
        "--pipeline-schedule", "zero-bubble", "--sequence-parallel", "--memory-pool"], True),
    # Sequence shards between stages: half the pipeline-link bytes without
    # the scatter/gather's extra synchronization.
    "ours-pp-sp-1f1b": ("ours", "ours: TP2 x PP2 1F1B, SP, pool", TP2 + PP2 + [
        "--pipeline-schedule", "1f1b", "--sequence-parallel", "--memory-pool"], True),
    # The same with SP's collectives pipelined behind the GEMMs (--tp-comm-overlap):
    # before/after pairs of that one change.
    "ours-pp-sp-1f1b-tpo": ("ours", "ours: TP2 x PP2 1F1B, SP, TP comm overlap, pool",
                            TP2 + PP2 + ["--pipeline-schedule", "1f1b", "--sequence-parallel",
                                         "--tp-comm-overlap", "--memory-pool"], True),
    "ours-dp-sp": ("ours", "ours: TP2 x DP2, SP, pool", TP2 + [
        "--sequence-parallel", "--memory-pool"], True),
    "ours-dp-sp-tpo": ("ours", "ours: TP2 x DP2, SP, TP comm overlap, pool", TP2 + [
        "--sequence-parallel", "--tp-comm-overlap", "--memory-pool"], True),
}
SUITES = {
    "peers": ["torch-ddp", "torch-fsdp2", "torch-tp2-ddp", "torch-pp", "torch-zb",
              "deepspeed-zero1", "deepspeed-zero2", "deepspeed-pp", "megatron-tp2-dp2",
              "megatron-tp2-pp2", "megatron-tp2-pp2-vp", "ours-dp", "ours-pp", "ours-pp-1f1b",
              "ours-pp-sp", "ours-pp-dp", "ours-pp-dp-int8",
              # the same transport for every stack, and our best layouts (issue 42)
              "torch-ddp-mapp", "torch-tp2-ddp-mapp", "torch-zb-mapp", "deepspeed-pp-mapp",
              "megatron-tp2-pp2-mapp", "megatron-pp4-mapp", "ours-pp-1f1b-mapp", "ours-pp4",
              "ours-pp-dp-zbv"],
    # make bench-step: ours against Megatron-Core, like for like (issue 26), also on
    # the same transport (issue 42).
    "step": ["megatron-tp2-pp2", "megatron-tp2-pp2-vp", "megatron-tp2-dp2", "megatron-pp4",
             "ours-pp-1f1b", "ours-pp-1f1b-sg", "ours-pp-sp-1f1b", "ours-pp", "ours-dp-exact",
             "ours-pp4-1f1b", "ours-pp4", "megatron-tp2-pp2-mapp", "megatron-pp4-mapp",
             "ours-pp-1f1b-mapp", "ours-pp-zbv", "ours-pp-dp-zbv", "ours-pp-sp-1f1b-tpo",
             "ours-dp-sp", "ours-dp-sp-tpo"],
    "e2e": ["torch-tp2-ddp", "torch-powersgd", "torch-pp", "torch-zb", "ours-dp",
            "ours-dp-onebit", "ours-pp"],
}
# make bench-fair: every stack on the same transport (issue 42): the peers on Gloo and on
# megatronapp's shared-memory backend (mapp), ours on Gloo only, on its own, and on mapp.
SUITES["fair"] = ["megatron-tp2-pp2", "megatron-tp2-pp2-mapp", "megatron-pp4", "megatron-pp4-mapp",
                  "megatron-tp2-dp2-mapp", "deepspeed-pp", "deepspeed-pp-mapp", "ours-pp-1f1b",
                  "ours-pp-1f1b-gloo", "ours-pp-1f1b-mapp", "ours-pp4-1f1b", "ours-pp4",
                  "ours-pp-dp", "ours-pp-dp-zero1", "ours-pp-dp-zero1-opg", "ours-pp-dp-zbv",
                  "ours-pp-zbv", "ours-dp-exact"]
# The Llama-shaped model (issue 41): ours against Megatron-Core with the same
# block flags (RMSNorm, SwiGLU, RoPE, GQA, no biases).
SUITES["llama"] = ["megatron-tp2-dp2", "megatron-tp2-pp2", "megatron-tp2-pp2-vp", "megatron-pp4",
                   "ours-dp-exact", "ours-pp-1f1b", "ours-pp-1f1b-gloo", "ours-pp",
                   "ours-pp4-1f1b", "ours-pp4"]
LLAMA_BLOCK = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
               "--rotary-base", "500000", "--group-query-attention", "--num-query-groups", "2",
               "--disable-bias-linear"]
# Pairs whose per-phase profiles the report subtracts (ours, theirs): like for like,
# then our best layouts against the best peer's (DeepSpeed PP2 x DP2 on the same transport).
PAIRS = [("ours-pp-1f1b", "megatron-tp2-pp2"), ("ours-dp-exact", "megatron-tp2-dp2"),
         ("ours-pp4-1f1b", "megatron-pp4"), ("ours-pp-1f1b-mapp", "megatron-tp2-pp2-mapp"),
         ("ours-pp4", "deepspeed-pp-mapp"), ("ours-pp-dp", "deepspeed-pp-mapp"),
         ("ours-pp-dp-zbv", "deepspeed-pp-mapp")]
MODEL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
         "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "16",
         "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "10", "--seed", "1234",
         "--untie-embeddings-and-output-weights"]
# --smoke: a model small enough that every stack runs a few steps in seconds.
SMOKE_MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
               "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
               "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "1", "--seed", "1234",
               "--untie-embeddings-and-output-weights"]


#: the model of each suite (default MODEL)
SUITE_MODEL = {"llama": MODEL[:MODEL.index("--seq-length")] + ["--ffn-hidden-size", "1408"]
               + MODEL[MODEL.index("--seq-length"):] + LLAMA_BLOCK}
SUITE_SMOKE_MODEL = {"llama": SMOKE_MODEL + LLAMA_BLOCK}

#: options a configuration may set for itself over the shared model flags: the
#: micro-batch size is a schedule choice (the global batch, hence the update, stays)
OVERRIDABLE = ("--micro-batch-size",)


def with_model(flags: list, rest: list) -> list:
    """A configuration's flags, then the shared ones (``rest``) less those the
    configuration overrides (OVERRIDABLE)."""
    rest = list(rest)
    for opt in OVERRIDABLE:
        if opt in flags and opt in rest:
            i = rest.index(opt)
            del rest[i:i + 2]
    return flags + rest


def backend_of(flags) -> str:
    return next((f[len(BACKEND_FLAG):] for f in flags if f.startswith(BACKEND_FLAG)), "gloo")
