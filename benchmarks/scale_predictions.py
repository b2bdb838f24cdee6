"""Scale model: reproduce Megatron-LM's published runs, then predict ours at 1k-10k GPUs.

    python benchmarks/scale_predictions.py [--markdown out.md]

1. Calibrates the matmul efficiency of the A100 description on GPT-3 175B
   (1,024 A100, TP8 x PP16 x DP8, batch 1536: 138 TFLOP/s per GPU, Megatron-LM
   README) and predicts the 1T-parameter run (3,072 A100, TP8 x PP64 x DP6,
   batch 3072: 502 PFLOP/s, Narayanan et al. 2021), which the fit never saw.
2. Strong-scales both models by data parallelism to 1,024-8,192 GPUs and
   compares Megatron-LM's schedule (1F1B / interleaved 1F1B, bf16 gradients,
   overlapped reduction) with ours (ZB-H1, int8 error-feedback gradients).
3. A bandwidth-limited cluster: the gradient codec decides.
4. Context parallelism on GPT-3 175B at 16K / 32K tokens against TP-only with
   the recomputation it needs to fit (Megatron-Core's context-parallel guide:
   1.25x for TP8CP2 at 16K, 1.20x for TP8CP4 at 32K).

All numbers are model outputs (see docs/performance.md for the inputs).
"""

from __future__ import annotations

import argparse
import dataclasses as dc
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "python"))

from megatronapp.tools import scale_model as sm  # noqa: E402

INT8_BYTES = 1.0 + 4 / 256  # int8 codec, block 256 (fp32 scale per block)
ONEBIT_BYTES = 1 / 8 + 4 / 256  # onebit codec, block 256 (sign bits + fp32 scale)


def megatron_and_ours(job, hw, grad_bytes):
    """Megatron's best plan for `job` (interleaved 1F1B with v=2 when the
    microbatch count allows, else 1F1B; bf16 gradients) and ours (the adaptive
    planner over 2 chunks, capped at Megatron's activation memory, with
    `grad_bytes` per gradient element); both overlap the gradient reduction."""
    v = 2 if job.microbatches % job.pp == 0 else 1
    meg = sm.predict(dc.replace(job, schedule="1f1b", vpp=v, overlap_dp=True), hw)
    limit = int(meg["peak_activation_layers"] * 2 * job.pp / job.num_layers)
    ours = sm.predict(dc.replace(job, schedule="dynamic", vpp=2, memory_limit=limit,
                                 grad_bytes=grad_bytes, overlap_dp=True), hw)
    return meg, ours


def context_parallel_table(hw) -> list:
    """Section 4: CP layouts of GPT-3 175B at 16K / 32K against TP-only with
    the recomputation it needs (Megatron-Core's context-parallel guide)."""
    out = []
    h100 = dc.replace(sm.H100_EOS, gemm_efficiency=hw.gemm_efficiency)
    out.append("")
    out.append("### Context parallelism: GPT-3 175B at long sequences, 512 H100 "
               "(TP8 x PP8, SP, 16 microbatches per pipeline; matmul efficiency as calibrated)\n")
    out.append("TP-only takes the least recomputation that fits 80 GB; each CP layout the "
               "same GPUs with dp / cp.\n")
    out.append("| sequence | layout | recompute | memory GB | tokens/s | vs TP8CP1 | published |")
    out.append("|---|---|---|---|---|---|---|")
    for seq, published in ((16384, {2: "1.25x"}), (32768, {4: "1.20x"})):
        base = sm.least_recompute(dc.replace(sm.GPT3_175B_LONG_512, seq_length=seq), h100)
        ref = sm.tokens_per_s(base, h100)
        rows = [("TP8CP1", base)] + [(f"TP8CP{c} {comm}", sm.context_parallel(base, c, h100, comm))
                                     for c in (2, 4, 8) for comm in ("p2p", "a2a")]
        for name, job in rows:
            tps = sm.tokens_per_s(job, h100)
            mem = sm.memory_per_gpu(job, h100)["total"] / 1e9
            out.append(f"| {seq // 1024}K | {name} | {job.recompute or 'none'} | {mem:.0f} | "
                       f"{tps:,.0f} | {tps / ref:.2f}x | "
                       f"{published.get(job.cp, '') if 'p2p' in name else ''} |")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--markdown", default=None, help="also write the tables here")
    a = p.parse_args()
    out = []
    hw = sm.calibrate(sm.GPT3_175B_1024, sm.A100_SELENE, 138.0)
    out.append("### Reproduction of published Megatron-LM runs (A100)\n")
    out.append(f"Calibrated on GPT-3 175B: matmul efficiency {hw.gemm_efficiency:.3f} of "
               f"{hw.peak_flops / 1e12:.0f} TFLOP/s (everything the model does not name is in it).\n")
    out.append("| run | schedule | published | predicted | error |")
    out.append("|---|---|---|---|---|")
    r = sm.predict(sm.GPT3_175B_1024, hw)
    out.append(f"| GPT-3 175B, 1,024 GPUs (fit) | 1F1B | 138 TFLOP/s/GPU | "
               f"{r['tflops_per_gpu']:.1f} TFLOP/s/GPU, {r['iteration_s']:.1f} s/iter | "
               f"{100 * (r['tflops_per_gpu'] / 138 - 1):+.1f}% |")
    for name, v in (("1f1b", 1), ("interleaved", 2)):
        job = dc.replace(sm.GPT_1T_3072, schedule=name, vpp=v)
        r = sm.predict(job, hw)
        label = "1F1B" if v == 1 else "interleaved, v=2"
        out.append(f"| 1T, 3,072 GPUs (held out) | {label} | 502 PFLOP/s | "
                   f"{r['aggregate_pflops']:.0f} PFLOP/s ({r['tflops_per_gpu']:.0f}/GPU), "
                   f"{r['iteration_s']:.0f} s/iter | {100 * (r['aggregate_pflops'] / 502 - 1):+.1f}% |")
    out.append("")
    out.append("### Recomputation: MT-NLG 530B on 2,240 A100 (Korthikanti et al. 2022)\n")
    full = dc.replace(sm.MT_NLG_530B_2240, recompute=True, sequence_parallel=False)
    useful = 0.421 * hw.peak_flops / 1e12
    hw530 = sm.calibrate(full, sm.A100_SELENE, useful * full.model_flops() / full.useful_flops())
    out.append(f"Calibrated on the full-recomputation run (42.1% model FLOPs utilization, same "
               f"paper and software): matmul efficiency {hw530.gemm_efficiency:.3f}.\n")
    out.append("| recomputation | published MFU | predicted MFU | predicted HFU | s/iter | error |")
    out.append("|---|---|---|---|---|---|")
    for label, job, pub in (("full (fit)", full, 0.421),
                            ("selective + sequence parallel (held out)", sm.MT_NLG_530B_2240,
                             0.542)):
        r = sm.predict(job, hw530)
        out.append(f"| {label} | {100 * pub:.1f}% | {100 * r['model_flops_utilization']:.1f}% | "
                   f"{100 * r['hardware_flops_utilization']:.1f}% | {r['iteration_s']:.1f} | "
                   f"{100 * (r['model_flops_utilization'] / pub - 1):+.1f}% |")
    out.append("")
    out.append("### Mixture of experts: DeepSeek-V3 on 2,048 H800 (technical report, arXiv 2412.19437)\n")
    h800 = dc.replace(sm.H800_DEEPSEEK, gemm_efficiency=hw.gemm_efficiency)
    ds = sm.DEEPSEEK_V3_2048
    out.append(f"Inputs: `scale_model.DEEPSEEK_V3_2048` and `H800_DEEPSEEK` (the report's model, "
               f"{ds.parameters() / 1e9:.0f}B parameters with its MTP depth's "
               f"{ds.mtp_parameters() / 1e9:.1f}B, {ds.forward_flops_per_token() / 1e9:.1f} "
               f"GFLOP per token forward; PP16 x EP64 x DP128, batch 15,360 x 4,096, FP8 GEMMs at "
               f"2x the bf16 rate, FP8 dispatch + BF16 combine, 3.5 node crossings per token and "
               f"layer, all-to-all hidden behind the layer's compute (DualPipe), stages balanced, "
               f"ZB-H1 standing in for DualPipe) and the matmul efficiency calibrated on GPT-3 175B "
               f"({hw.gemm_efficiency:.3f}); the model never saw DeepSeek's number.\n")
    out.append("| variant | predicted H800 GPU-hours per 10^12 tokens | vs published 180K | "
               "MFU (bf16 peak) | s/iter |")
    out.append("|---|---|---|---|---|")
    for label, kw in (("as published (reproduction)", {}),
                      ("all-to-all not overlapped", {"a2a_overlap": 0.0}),
                      ("bf16 GEMMs instead of FP8", {"fp8": False}),
                      ("1F1B instead of a zero-bubble schedule", {"schedule": "1f1b"}),
                      ("busiest GPU 1.2x the mean expert load", {"expert_imbalance": 1.2}),
                      ("output layer and MTP on the last stage (unbalanced)",
                       {"balance_stages": False}),
                      ("without the MTP depth", {"mtp_layers": 0})):
        job = dc.replace(ds, **kw)
        r = sm.predict(job, h800)
        gh = sm.gpu_hours_per_trillion_tokens(job, h800)
        out.append(f"| {label} | {gh / 1e3:.0f}K | {100 * (gh / 180e3 - 1):+.1f}% | "
                   f"{100 * r['model_flops_utilization']:.1f}% | {r['iteration_s']:.1f} |")
    out.append("")
    out.append("### Dense Llama: Llama 3 405B on 8,192 and 16,384 H100 (Llama 3 paper, Table 4)\n")
    h100 = dc.replace(sm.H100_EOS, gemm_efficiency=hw.gemm_efficiency)
    ll = sm.LLAMA3_405B_8192
    out.append(f"Inputs: `scale_model.LLAMA3_405B_8192` and `H100_EOS` ({ll.parameters() / 1e9:.0f}B "
               "parameters: 126 layers, hidden 16,384, 128 heads in 8 query groups, SwiGLU 53,248, "
               "vocabulary 128,256; sequence 8,192, 2,048 sequences per batch, BF16, TP8 x PP16 "
               "x DP64 (DP128 on 16,384), interleaved 1F1B with one layer per virtual stage, no "
               "recomputation, sequence parallelism, overlapped gradients, stages balanced) and "
               f"the matmul efficiency calibrated on GPT-3 175B ({hw.gemm_efficiency:.3f}); the "
               "model never saw Llama's numbers. Published: 430 and 400 TFLOP/s per GPU (BF16 "
               "model FLOPs, 43% and 41% MFU).\n")
    out.append("| GPUs | variant | predicted TFLOP/s per GPU | vs published | bubble | s/iter |")
    out.append("|---|---|---|---|---|---|")
    for gpus, pub in ((8192, 430.0), (16384, 400.0)):
        for label, kw in (("as assumed (reproduction)", {}),
                          ("selective recomputation", {"recompute": "selective"}),
                          ("2 layers per virtual stage (vpp 4)", {"vpp": 4}),
                          ("1F1B without virtual stages", {"vpp": 1})):
            job = dc.replace(sm.gpus_for(ll, gpus), **kw)
            r = sm.predict(job, h100)
            got = r["model_flops_utilization"] * h100.peak_flops / 1e12
            out.append(f"| {gpus:,} | {label} | {got:.0f} | {100 * (got / pub - 1):+.1f}% | "
                       f"{100 * r['bubble_fraction']:.1f}% | {r['iteration_s']:.1f} |")
    out.append("")
    out.append("### Predicted strong scaling by data parallelism (same global batch)\n")
    out.append("Megatron = its best schedule here (interleaved 1F1B with v=2 where the microbatch count "
               "allows, else 1F1B), bf16 gradients, "
               "reduction overlapped; ours = the adaptive dynamic planner over 2 model "
               "chunks per stage (it keeps the best of interleaved, depth-first, breadth-first "
               "and ZB-H1 plans under the modelled costs), capped at Megatron's peak activation "
               "memory, and int8 error-feedback gradients, overlapped.\n")
    out.append("| model | GPUs | microbatches/pipeline | Megatron schedule | Megatron TFLOP/s/GPU | "
               "bubble | ours: plan chosen | TFLOP/s/GPU | bubble | activation memory vs Megatron | "
               "ours / Megatron |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for base, gpus_list in ((sm.GPT3_175B_1024, (1024, 2048, 4096, 8192)),
                            (sm.GPT_1T_3072, (1024, 3072, 6144, 8192))):
        label = "GPT-3 175B" if base is sm.GPT3_175B_1024 else "1T"
        for gpus in gpus_list:
            job = sm.gpus_for(base, gpus)
            meg, ours = megatron_and_ours(job, hw, INT8_BYTES)
            out.append(f"| {label} | {gpus:,} | {job.microbatches} | {meg['schedule']} | "
                       f"{meg['tflops_per_gpu']:.0f} | "
                       f"{100 * meg['bubble_fraction']:.1f}% | {ours['schedule']} | "
                       f"{ours['tflops_per_gpu']:.0f} | {100 * ours['bubble_fraction']:.1f}% | "
                       f"{ours['peak_activation_layers'] / meg['peak_activation_layers']:.2f}x | "
                       f"{ours['tflops_per_gpu'] / meg['tflops_per_gpu']:.2f}x |")
    # 3. A bandwidth-limited cluster: the same H100 nodes with 2 x 100 Gbit/s
    # Ethernet per node (3.1 GB/s per GPU) instead of 8 x 400 Gbit/s InfiniBand.
    cloud = dc.replace(sm.H100_EOS, name="8x H100 per node, 2x 100 GbE per node",
                       inter_bandwidth=25e9 / 8, inter_latency=25e-6,
                       gemm_efficiency=hw.gemm_efficiency)
    out.append("")
    out.append(f"### Bandwidth-limited cluster ({cloud.name}; matmul efficiency as calibrated)\n")
    out.append("Same schedules as above; the data-parallel reduction no longer hides behind the "
               "last backward passes, so the gradient codec decides.\n")
    out.append("| model | GPUs | Megatron (bf16 grads) TFLOP/s/GPU | exposed DP s | ours int8 | "
               "exposed DP s | ours onebit | exposed DP s | int8 / Megatron | onebit / Megatron |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for gpus in (1024, 4096):
        job = sm.gpus_for(sm.GPT3_175B_1024, gpus)
        meg, int8 = megatron_and_ours(job, cloud, INT8_BYTES)
        _, onebit = megatron_and_ours(job, cloud, ONEBIT_BYTES)
        ours = {"int8": int8, "onebit": onebit}
        out.append(f"| GPT-3 175B | {gpus:,} | {meg['tflops_per_gpu']:.0f} | "
                   f"{meg['dp_exposed_s']:.2f} | {ours['int8']['tflops_per_gpu']:.0f} | "
                   f"{ours['int8']['dp_exposed_s']:.2f} | {ours['onebit']['tflops_per_gpu']:.0f} | "
                   f"{ours['onebit']['dp_exposed_s']:.2f} | "
                   f"{ours['int8']['tflops_per_gpu'] / meg['tflops_per_gpu']:.2f}x | "
                   f"{ours['onebit']['tflops_per_gpu'] / meg['tflops_per_gpu']:.2f}x |")
    out += context_parallel_table(hw)
    text = "\n".join(out) + "\n"
    print(text, end="")
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
