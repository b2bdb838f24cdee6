"""Checkpoints: bit-identical resume (ZeRO-1 + int8 error feedback, and a
pipeline, each also in mixed precision: bf16 masters, fp16 loss scale),
resharding across (tp, pp, dp), atomic commit, and clear errors on
corrupted or incompatible checkpoints."""

import json
import os

import pytest

import torch
from dist_harness import run_ranks

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-iters", "1", "--no-progress",
         "--log-interval", "1000"]


def _train(rank, world, extra, out_dir):
    from megatronapp.pretrain import build_parser, train

    args = build_parser().parse_args(MODEL + extra + ["--output-dir", out_dir])
    s = train(args)
    return s["losses"], s["valid_loss"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
     "--grad-compression", "int8"],
    ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zero-bubble",
     "--async-save"],
    ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
     "--grad-compression", "int8", "--bf16"],
    ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zero-bubble", "--fp16",
     "--initial-loss-scale", "4096", "--loss-scale-window", "2"],
    # saved while the parameter all-gathers of the step are still in flight
    ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zero-bubble",
     "--use-distributed-optimizer", "--overlap-param-gather", "--async-save"],
], ids=["tp2xdp2-zero1-int8", "pp2xdp2-zb-async", "bf16-tp2xdp2-zero1-int8",
        "fp16-pp2xdp2-zb-scaler", "pp2xdp2-zb-zero1-overlap-param-gather"])
def test_resume_is_bit_identical(tmp_path, layout):
    ck = str(tmp_path / "ck")
    full = run_ranks(_train, 4, layout + ["--train-iters", "6", "--save", ck,
                                          "--save-interval", "3"], str(tmp_path / "a"))
    resumed = run_ranks(_train, 4, layout + ["--train-iters", "6", "--load",
                                             os.path.join(ck, "iter_0000003")],
                        str(tmp_path / "b"))
    for (a, _), (b, _) in zip(full, resumed, strict=True):
        assert b == a[3:], (a, b)  # exact float equality
    with open(os.path.join(ck, "latest")) as f:
        assert f.read().strip() == "iter_0000006"
    assert not [d for d in os.listdir(ck) if d.startswith(".tmp")]


@pytest.mark.timeout(600)
def test_zb_v_resumes_bit_identically_and_reshards_into_one_rank(tmp_path):
    """ZB-V's wave puts layers 0 and 3 (and the tied embedding and output
    layer) on stage 0: a ZeRO-1 PP2 x DP2 checkpoint resumes bit for bit and
    loads into one rank's 1F1B model (the global layer names do not move)."""
    ck = str(tmp_path / "ck")
    zbv = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v",
           "--use-distributed-optimizer"]
    full = run_ranks(_train, 4, zbv + ["--train-iters", "4", "--save", ck, "--save-interval", "3"],
                     str(tmp_path / "a"))
    resumed = run_ranks(_train, 4, zbv + ["--train-iters", "4", "--load",
                                          os.path.join(ck, "iter_0000003")], str(tmp_path / "b"))
    for (a, _), (b, _) in zip(full, resumed, strict=True):
        assert b == a[3:], (a, b)  # exact float equality
    one = run_ranks(_train, 1, ["--train-iters", "4", "--load", os.path.join(ck, "iter_0000003")],
                    str(tmp_path / "c"))
    assert abs(one[0][0][0] - full[0][0][3]) < 1e-5, (one[0][0], full[0][0])


@pytest.mark.timeout(600)
def test_reshard_tp2_pp2_into_tp1_and_dp4(tmp_path):
    ck = str(tmp_path / "ck")
    src = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    (losses, _), *_ = run_ranks(_train, 4, src + ["--train-iters", "3", "--save", ck],
                                str(tmp_path / "a"))
    # Continue from the checkpoint under other layouts: the loss of step 4 is
    # computed by the loaded weights before any update.
    ref, *_ = run_ranks(_train, 4, src + ["--train-iters", "4", "--load", ck], str(tmp_path / "r"))
    one = run_ranks(_train, 1, ["--train-iters", "4", "--load", ck], str(tmp_path / "b"))
    dp4 = run_ranks(_train, 4, ["--train-iters", "4", "--load", ck, "--use-distributed-optimizer"],
                    str(tmp_path / "c"))
    for got in [one[0]] + dp4:
        assert abs(got[0][0] - ref[0][0]) < 1e-6, (got[0][0], ref[0][0])
        assert abs(got[1] - ref[1]) < 1e-4  # after one more (resharded) update


def _save_small(rank, world, ck):
    import megatronapp as mapp
    from megatronapp import checkpoint
    from megatronapp.models import GPTConfig, GPTModel

    state = mapp.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=64, hidden_size=32, num_layers=2,
                               num_attention_heads=4, seq_length=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))).mean().backward()
    opt.step()
    checkpoint.save(ck, 5, [model], opt, config={"hidden_size": 32}, parallel_state=state)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _load_small(rank, world, ck, hidden, cfg_hidden):
    import megatronapp as mapp
    from megatronapp import checkpoint
    from megatronapp.models import GPTConfig, GPTModel

    state = mapp.initialize_model_parallel(1, 1)
    model = GPTModel(GPTConfig(vocab_size=64, hidden_size=hidden, num_layers=2,
                               num_attention_heads=4, seq_length=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        info = checkpoint.load(ck, [model], opt, config={"hidden_size": cfg_hidden},
                               parallel_state=state)
    except checkpoint.CheckpointError as e:
        return "error", str(e)
    return info["iteration"], {n: p.detach().clone() for n, p in model.named_parameters()}


def test_corruption_and_incompatibility_are_clear_errors(tmp_path):
    ck = str(tmp_path / "ck")
    saved = run_ranks(_save_small, 1, ck)[0]
    it, loaded = run_ranks(_load_small, 1, ck, 32, 32)[0]
    assert it == 5 and all(torch.equal(saved[n], loaded[n]) for n in saved)
    data = os.path.join(ck, "iter_0000005", "rank0.safetensors")
    blob = bytearray(open(data, "rb").read())
    # Wrong model: the config check, then the shapes.
    kind, msg = run_ranks(_load_small, 1, ck, 32, 48)[0]
    assert kind == "error" and "hidden_size = 32 in the checkpoint, 48 here" in msg
    kind, msg = run_ranks(_load_small, 1, ck, 48, 32)[0]
    assert kind == "error" and "global shape" in msg and "incompatible model" in msg
    # One flipped byte in the last tensor's data.
    bad = bytearray(blob)
    bad[-3] ^= 0x40
    open(data, "wb").write(bytes(bad))
    kind, msg = run_ranks(_load_small, 1, ck, 32, 32)[0]
    assert kind == "error" and "checksum mismatch in tensor" in msg and "rank0.safetensors" in msg
    # Truncated.
    open(data, "wb").write(bytes(blob[: len(blob) // 2]))
    kind, msg = run_ranks(_load_small, 1, ck, 32, 32)[0]
    assert kind == "error" and "rank0.safetensors" in msg and ("outside the file" in msg
                                                             or "truncated" in msg)
    # A `latest` that names garbage.
    open(data, "wb").write(bytes(blob))
    with open(os.path.join(ck, "latest"), "w") as f:
        f.write("../../etc\n")
    kind, msg = run_ranks(_load_small, 1, ck, 32, 32)[0]
    assert kind == "error" and "does not name a checkpoint" in msg
    # Malformed metadata.
    with open(os.path.join(ck, "latest"), "w") as f:
        f.write("iter_0000005\n")
    meta = os.path.join(ck, "iter_0000005", "metadata.json")
    m = json.load(open(meta))
    m["format"] = 99
    json.dump(m, open(meta, "w"))
    kind, msg = run_ranks(_load_small, 1, ck, 32, 32)[0]
    assert kind == "error" and "not a megatronapp checkpoint" in msg


def _verify_latest(rank, world, ck):
    import megatronapp as mapp
    from megatronapp import checkpoint
    from megatronapp.models import GPTConfig, GPTModel

    state = mapp.initialize_model_parallel(1, 1)
    model = GPTModel(GPTConfig(vocab_size=256, hidden_size=256, num_layers=4,
                               num_attention_heads=4, seq_length=64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    info = checkpoint.load(ck, [model], opt, config={"hidden_size": 256}, parallel_state=state)
    return None if info is None else info["iteration"]


@pytest.mark.timeout(300)
def test_killing_the_writer_never_breaks_latest(tmp_path):
    """SIGKILL the saving process at random points: `latest` always loads
    (checksums verified) and names a complete checkpoint."""
    import random
    import signal
    import subprocess
    import sys

    from dist_harness import free_port

    rng = random.Random(1)
    ck = str(tmp_path / "ck")
    helper = os.path.join(os.path.dirname(__file__), "ckpt_writer.py")
    last = None
    for k in range(3):
        p = subprocess.Popen([sys.executable, helper, ck, str(free_port())],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert p.stdout.readline().strip() == "ready"
        if k == 0:  # one committed checkpoint first (a loaded machine may be slow to reach it)
            assert p.stdout.readline().strip() == "saved"
        import time

        time.sleep(rng.uniform(0.3, 2.0))
        p.send_signal(signal.SIGKILL)
        p.wait()
        it = run_ranks(_verify_latest, 1, ck)[0]
        if it is not None:
            assert last is None or it >= 1
            last = it
    assert last is not None  # at least one checkpoint committed across the kills


def test_files_of_the_first_format_still_read(tmp_path):
    """tests/python/data/format_v1.safetensors was written by the hand-written
    writer of format 1 (before the safetensors package was used)."""
    import shutil

    from megatronapp.checkpoint.format import CheckpointError, read, write

    path = os.path.join(os.path.dirname(__file__), "data", "format_v1.safetensors")
    tensors, meta = read(path)
    assert meta["rank"] == "3" and meta["iteration"] == "42"
    assert torch.equal(tensors["a/f32"], torch.arange(12, dtype=torch.float32).reshape(3, 4) / 4)
    assert torch.equal(tensors["b/bf16"], torch.arange(5, dtype=torch.bfloat16) - 2)
    assert tensors["c/i64"].item() == 7 and tensors["c/i64"].dim() == 0
    assert torch.equal(tensors["d/u8"], torch.arange(3, dtype=torch.uint8))
    assert tensors["e/empty"].shape == (0, 2)
    # Its CRCs are checked too.
    bad = tmp_path / "bad.safetensors"
    shutil.copy(path, bad)
    blob = bytearray(bad.read_bytes())
    blob[-30] ^= 0x01
    bad.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read(str(bad))
    # A round trip through the new writer gives the same tensors (views of one
    # buffer included) and a file any safetensors reader opens.
    from safetensors.torch import load_file

    buf = torch.arange(10, dtype=torch.float32)
    out = tmp_path / "new.safetensors"
    write(str(out), {"x": buf[:4].view(2, 2), "y": buf[4:], **tensors}, {"iteration": 1})
    again, meta2 = read(str(out))
    assert torch.equal(again["x"], buf[:4].view(2, 2)) and torch.equal(again["y"], buf[4:])
    assert json.loads(meta2["iteration"]) == 1
    assert set(load_file(str(out))) == {"x", "y", *tensors}
