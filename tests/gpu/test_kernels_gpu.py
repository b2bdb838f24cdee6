"""GPU tier: CUDA kernels against the CPU reference (skipped without a GPU).
Run on a CUDA machine with `make gpu-check`."""

import os
import socket

import pytest
import torch.nn.functional as F

import megatronapp  # noqa: F401  (registers torch.ops.mapp)
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab,start", [(7, 33, 0), (513, 25152, 25152), (64, 1, 5)])
def test_ce_stats_kernel_matches_cpu_reference(dtype, rows, vocab, start):
    torch.manual_seed(0)
    logits = (4 * torch.randn(rows, vocab)).to(dtype)
    target = torch.randint(start, start + vocab, (rows,))
    target[::3] = -100  # outside the shard
    want = torch.ops.mapp.vocab_ce_local_stats(logits.float(), target, start)
    got = torch.ops.mapp.vocab_ce_local_stats(logits.cuda(), target.cuda(), start).cpu()
    assert got.dtype == torch.float32 and got.shape == (rows, 3)
    torch.testing.assert_close(got[:, 0], want[:, 0], rtol=0, atol=0)  # max is exact
    torch.testing.assert_close(got[:, 1], want[:, 1], rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(got[:, 2], want[:, 2], rtol=0, atol=0)


def test_ce_stats_kernel_on_strided_rows():
    logits = torch.randn(16, 2, 300, device="cuda")[:, 0, :]  # row stride 600
    target = torch.randint(0, 300, (16,), device="cuda")
    got = torch.ops.mapp.vocab_ce_local_stats(logits, target, 0).cpu()
    want = torch.ops.mapp.vocab_ce_local_stats(logits.cpu().contiguous(), target.cpu(), 0)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6)


def _single_rank_nccl():
    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)


def test_vocab_parallel_cross_entropy_on_cuda_matches_torch():
    import megatronapp as mapp
    from megatronapp.tensor_parallel import vocab_parallel_cross_entropy

    _single_rank_nccl()
    if not mapp.model_parallel_is_initialized():
        mapp.initialize_model_parallel()
    logits = torch.randn(64, 4, 1000, device="cuda", requires_grad=True)
    target = torch.randint(0, 1000, (64, 4), device="cuda")
    loss = vocab_parallel_cross_entropy(logits, target)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, 1000), target.view(-1), reduction="none").view(64, 4)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    g = torch.rand_like(ref)
    (loss * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-6)


def test_cuda_pool_serves_torch_and_reuses_memory():
    """In a fresh process (the allocator swap must precede any CUDA allocation)."""
    import subprocess
    import sys

    code = (
        "import torch, megatronapp as mapp\n"
        "mapp.memory.use_pool('cuda')\n"
        "a = torch.randn(1024, 1024, device='cuda'); b = a @ a; s = float(b.sum())\n"
        "del a, b\n"
        "c = torch.randn(1024, 1024, device='cuda'); torch.cuda.synchronize()\n"
        "st = mapp.memory.stats('cuda')\n"
        "assert st['num_cache_hits'] >= 1, st\n"
        "assert st['allocated_bytes'] >= 4 * 1024 * 1024, st\n"
        "print('ok', st['peak_reserved_bytes'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


@pytest.mark.parametrize("spec", ["bf16", "fp16", "int8:64", "onebit:32"])
@pytest.mark.parametrize("n", [1, 1000, 1 << 20])
def test_codec_kernels_match_cpu_reference(spec, n):
    torch.manual_seed(1)
    x = torch.randn(n) * 3
    err = torch.randn(n) * 0.1
    want_err = err.clone()
    want = torch.ops.mapp.codec_encode(x, spec, want_err)
    got_err = err.cuda()
    got = torch.ops.mapp.codec_encode(x.cuda(), spec, got_err).cpu()
    assert got.shape == want.shape
    if spec in ("bf16", "fp16"):
        assert torch.equal(got, want)  # round-to-nearest-even on both
    else:  # scales may differ in the last bit (float vs double reductions)
        dec_gpu = torch.ops.mapp.codec_decode(got.cuda(), spec, n).cpu()
        dec_cpu = torch.ops.mapp.codec_decode(want, spec, n)
        torch.testing.assert_close(dec_gpu, dec_cpu, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_err.cpu(), want_err, rtol=1e-4, atol=1e-4)
    # decoding on the GPU equals decoding on the CPU for the same payload
    torch.testing.assert_close(torch.ops.mapp.codec_decode(want.cuda(), spec, n).cpu(),
                               torch.ops.mapp.codec_decode(want, spec, n), rtol=0, atol=0)


@pytest.mark.parametrize("device_index", [0, 1])
def test_comm_work_orders_after_the_producer_stream_and_before_the_consumer(device_index):
    """The worker thread waits for the caller's stream before reading, runs on
    the tensors' device, and the caller's stream waits for the worker: a
    buffer still being written by a slow kernel is reduce-scattered only after
    it, and the result is right on the caller's stream."""
    if device_index >= torch.cuda.device_count():
        pytest.skip(f"needs {device_index + 1} CUDA devices")
    import torch.distributed as dist

    _single_rank_nccl()
    dev = torch.device("cuda", device_index)
    side = torch.cuda.Stream(device=dev)
    with torch.cuda.device(dev), torch.cuda.stream(side):
        buf = torch.zeros(1 << 20, device=dev)
        out = torch.empty(1 << 20, device=dev)
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the write
        buf.fill_(3.0)
        work = torch.ops.mapp.compressed_reduce_scatter_async(
            buf, "none", [], [], out, False, dist.group.WORLD.group_name)
        work.wait()
        got = out.sum().item()  # on the side stream, after the work
    assert got == 3.0 * (1 << 20)
    assert work.is_completed()


# ---- MoE dispatcher kernels (kernels/moe.cu) against the CPU reference ----------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("capacity,pad", [(-1, False), (5, False), (6, True)])
def test_moe_dispatch_combine_kernels_match_cpu(dtype, capacity, pad):
    torch.manual_seed(0)
    T, k, E, h = 37, 2, 4, 96
    x = torch.randn(T, h).to(dtype)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    idx[3, 1] = -1  # not routed
    w = torch.rand(T, k)
    ops = torch.ops.mapp
    want_rows, want_tpe, plan = ops.moe_dispatch(x, idx, E, capacity, pad, "none", "")
    rows, tpe, plan_gpu = ops.moe_dispatch(x.cuda(), idx.cuda(), E, capacity, pad, "none", "")
    assert torch.equal(tpe, want_tpe) and torch.equal(plan_gpu, plan)
    torch.testing.assert_close(rows.cpu(), want_rows, rtol=0, atol=0)  # a permutation
    y = (want_rows.float() * 1.5).to(dtype)
    want_out, want_back = ops.moe_combine(y, plan, w, "")
    out, back = ops.moe_combine(y.cuda(), plan, w.cuda(), "")
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.cpu().float(), want_out.float(), rtol=tol, atol=tol)
    g = torch.randn(T, h).to(dtype)
    torch.testing.assert_close(ops.moe_weight_grads(g.cuda(), back, plan).cpu().float(),
                               ops.moe_weight_grads(g, want_back, plan).float(),
                               rtol=tol * 10, atol=tol * 10)
    torch.testing.assert_close(ops.moe_dispatch_with_plan(g.cuda(), plan, w.cuda(), "").cpu()
                               .float(), ops.moe_dispatch_with_plan(g, plan, w, "").float(),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [True, False])
def test_moe_grouped_gemm_matches_the_cpu_loop(dtype, transposed):
    torch.manual_seed(0)
    counts = [5, 0, 17, 3]  # an expert without rows
    x = torch.randn(sum(counts), 64).to(dtype)
    ws = [torch.randn(*((48, 64) if transposed else (64, 48))).to(dtype) for _ in counts]
    want = torch.ops.mapp.moe_grouped_gemm(x.float(), counts, [w.float() for w in ws],
                                           transposed)
    got = torch.ops.mapp.moe_grouped_gemm(x.cuda(), counts, [w.cuda() for w in ws], transposed)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.cpu().float(), want, rtol=tol, atol=tol * 8)


def test_cpp_trainer_on_nccl_matches_its_cpu_run(tmp_path):
    """examples/cpp/train_gpt with --distributed-backend nccl (one rank, its
    GPU; NCCL groups created from C++, the model, DDP buckets and pipeline
    buffers on CUDA) against the same run on Gloo/CPU: the same losses
    within 1e-4 (different kernels, fp32)."""
    import csv
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    exe = os.path.join(root, "build", "py", "examples", "train_gpt")
    from megatronapp.data import default_corpus

    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
             "--train-iters", "10", "--data-path", default_corpus()]
    losses = {}
    for backend in ("gloo", "nccl"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        out = tmp_path / f"{backend}.csv"
        p = subprocess.run([exe, *flags, "--distributed-backend", backend, "--loss-csv", str(out)],
                           env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        with open(out) as f:
            losses[backend] = [float(r["loss"]) for r in csv.DictReader(f)]
    assert len(losses["nccl"]) == 10
    for a, b in zip(losses["gloo"], losses["nccl"], strict=True):
        assert abs(a - b) < 1e-4, losses


def test_fused_adamw_kernel_matches_the_cpu_core():
    """The CUDA AdamW (more than 32 tensors: two launches) against the CPU core,
    same scalars, within float32 rounding; the optimizer front-end on CUDA."""
    from megatronapp.optimizer import FusedAdamW

    g = torch.Generator().manual_seed(0)
    shapes = [(3,), (1000,), (64, 33)] * 12
    cpu = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    oc, og = FusedAdamW(cpu, lr=1e-2, betas=(0.9, 0.95)), FusedAdamW(gpu, lr=1e-2, betas=(0.9, 0.95))
    for _ in range(4):
        for a, b in zip(cpu, gpu, strict=True):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.cuda()
        oc.step()
        og.step()
    torch.cuda.synchronize()
    worst = max((a - b.cpu()).abs().max().item() for a, b in zip(cpu, gpu, strict=True))
    assert worst < 1e-6, worst


# ---- --tp-comm-overlap on CUDA (tensor_parallel/overlap.py) ---------------------------
@pytest.mark.parametrize("splits", [1, 4])
def test_overlapped_tp_linears_on_cuda_match_the_unsplit_linear(splits):
    """The pipelined pieces run their collectives on the comm thread's stream
    (a group of one: a device copy), ordered after the GEMMs that produced
    them and before the GEMMs that read them: output and gradients equal the
    plain linears (float64, so any misordering shows as garbage, not noise)."""
    import torch.distributed as dist

    from megatronapp.tensor_parallel import TPCommOverlap, overlap

    _single_rank_nccl()
    group = dist.group.WORLD
    ov = TPCommOverlap(splits=splits)
    torch.manual_seed(0)
    kw = {"device": "cuda", "dtype": torch.float64}
    x = torch.randn(64, 2, 96, **kw).requires_grad_()
    w1, b1 = torch.randn(128, 96, **kw).requires_grad_(), torch.randn(128, **kw).requires_grad_()
    w2 = torch.randn(96, 128, **kw).requires_grad_()
    gy = torch.randn(64, 2, 96, **kw)
    y = overlap.row_linear(torch.relu(overlap.column_linear(x, w1, b1, group, ov)), w2, group, ov)
    (y * gy).sum().backward()
    got = [y.detach(), x.grad, w1.grad, b1.grad, w2.grad]
    for t in (x, w1, b1, w2):
        t.grad = None
    y = F.linear(torch.relu(F.linear(x, w1, b1)), w2)
    (y * gy).sum().backward()
    for a, b in zip(got, [y.detach(), x.grad, w1.grad, b1.grad, w2.grad], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---- FP8 GEMMs on tensor cores (fp8.gemm: torch._scaled_mm) ---------------------------
@pytest.mark.parametrize("dtypes", [("e4m3", "e4m3"), ("e5m2", "e4m3")])
@pytest.mark.parametrize("m,k,n", [(64, 128, 32), (48, 80, 16), (40, 64, 32)])
def test_fp8_gemm_on_tensor_cores_matches_the_emulation(dtypes, m, k, n):
    """The same FP8 operands and scales: the tensor-core product equals the
    float32 product of the dequantized operands up to summation order (and
    a shape that is not a multiple of 16 falls back to that product)."""
    from megatronapp import fp8

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9+")
    kinds = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    torch.manual_seed(0)
    a, b = torch.randn(m, k) * 3, torch.randn(n, k) * 0.05
    sa, sb = torch.tensor(448.0 / 9.0), torch.tensor(448.0 / 0.2)
    a8, b8 = fp8.to_fp8(a, sa, kinds[dtypes[0]]), fp8.to_fp8(b, sb, kinds[dtypes[1]])
    want = fp8.gemm(a8, sa, b8, sb)  # CPU: the emulation
    got = fp8.gemm(a8.cuda(), sa.cuda(), b8.cuda(), sb.cuda())
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert fp8._tensor_cores(a8.cuda(), b8.cuda()) == (m % 16 == 0)  # noqa: SLF001
    torch.testing.assert_close(got.cpu(), want, rtol=1e-3, atol=1e-3)
