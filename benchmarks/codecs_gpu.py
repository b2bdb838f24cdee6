"""GPU codec kernels: checked against the CPU reference on fresh random data,
then timed against the device's measured copy bandwidth (table printed last).

    python benchmarks/codecs_gpu.py         (part of make gpu-check)

Goal: quantize/dequantize at >= 60% of copy bandwidth. Bandwidth counts the
bytes each kernel must move: encode reads x and err and writes err and the
payload; decode reads the payload and writes float32.
"""

from gpu_timing import timed_ms

import megatronapp  # noqa: F401
import torch


def main():
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    n = 64 * 1024 * 1024
    x = torch.randn(n, device="cuda")
    err = torch.zeros(n, device="cuda")
    dst = torch.empty_like(x)
    copy_ms = timed_ms(lambda: dst.copy_(x))
    copy_bw = 2 * 4 * n / copy_ms / 1e6  # GB/s, read + write
    rows = []
    for spec in ("bf16", "fp16", "int8", "onebit:32"):
        small = torch.randn(1 << 16)
        e_cpu = torch.zeros_like(small)
        ref = torch.ops.mapp.codec_decode(torch.ops.mapp.codec_encode(small, spec, e_cpu), spec,
                                          small.numel())
        e_gpu = torch.zeros_like(small).cuda()
        got = torch.ops.mapp.codec_decode(
            torch.ops.mapp.codec_encode(small.cuda(), spec, e_gpu), spec, small.numel()).cpu()
        check = "ok" if torch.allclose(got, ref, rtol=1e-4, atol=1e-4) else "MISMATCH"
        payload = torch.ops.mapp.codec_encode(x, spec, err)
        enc_ms = timed_ms(lambda: torch.ops.mapp.codec_encode(x, spec, err))
        dec_ms = timed_ms(lambda: torch.ops.mapp.codec_decode(payload, spec, n))
        enc_bytes = 3 * 4 * n + payload.numel()  # read x, read+write err, write payload
        dec_bytes = payload.numel() + 4 * n
        rows.append((spec, check, enc_bytes / enc_ms / 1e6, dec_bytes / dec_ms / 1e6))
    print(f"\ncopy bandwidth {copy_bw:.0f} GB/s ({torch.cuda.get_device_name()}), "
          f"{n / 2**20:.0f} Mi float32 elements")
    print(f"{'codec':<10} {'vs CPU':>7} {'encode GB/s':>12} {'% copy':>7} {'decode GB/s':>12} {'% copy':>7}")
    for spec, check, e, d in rows:
        print(f"{spec:<10} {check:>7} {e:>12.0f} {100 * e / copy_bw:>6.0f}% {d:>12.0f} "
              f"{100 * d / copy_bw:>6.0f}%")


if __name__ == "__main__":
    main()
