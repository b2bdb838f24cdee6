"""The LLaVA-style VLM (megatronapp.models.VLM): the image embeddings land
where each row's image token was, the loss counts text targets only
(against a float64 cross-entropy by hand; zero gradient at image
positions), causality across the placement; on the training edge
(examples/pretrain_vlm.py's path) the same losses under TP2, TP2+SP, PP2,
PP2 x DP2 with ZeRO-1 and zero-bubble, and MegaFBD, a bit-identical resume
across pipeline stages, clear errors, and a caption loss below the
text-only model's on the same captions."""

from __future__ import annotations

import pytest

import torch
from dist_harness import (
    PP2_DP2_ZERO1_ZB,
    PP2_FBD_RECOMPUTE,
    assert_same_training,
    error_messages,
    run_ranks,
)


def _small_vlm(state, seed=5):
    from megatronapp.models import VLM, GPTConfig, ViTConfig, VLMConfig

    vision = ViTConfig(hidden_size=16, num_layers=1, num_attention_heads=2, img_h=8, img_w=8,
                       patch_dim=4)  # 4 patches + the class token
    cfg = VLMConfig(language=GPTConfig(vocab_size=16, hidden_size=32, num_layers=2,
                                       num_attention_heads=4, seq_length=11),
                    vision=vision, image_token_id=3)
    return cfg, VLM(cfg, parallel_state=state, seed=seed).double()


def _placement_and_loss(rank, world):
    import megatronapp
    from megatronapp.models.vlm import IGNORE_INDEX, combined_labels, masked_token_loss

    state = megatronapp.initialize_model_parallel()
    cfg, model = _small_vlm(state)
    p, t = cfg.num_image_tokens, cfg.text_length
    assert (p, t) == (5, 7)
    tokens = torch.tensor([[3, 4, 5, 6, 7, 2, 0],    # image first
                           [1, 4, 3, 5, 6, 7, 2],    # image third
                           [1, 4, 5, 6, 7, 2, 3]])   # image last
    torch.manual_seed(0)
    images = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    out = {}
    with torch.no_grad():
        emb = model.embed(images, tokens)
        img = model.projector(model.vision(images))
        words = model.word_embeddings(tokens)
    placed = []
    for b, k in enumerate([0, 2, 6]):
        want = torch.cat([words[b, :k], img[b], words[b, k + 1:]])
        placed.append(float((emb[b] - want).abs().max()))
    out["placed"] = placed
    labels = combined_labels(tokens, 3, p, ignore_ids=(0,))
    out["labels"] = labels.tolist()
    logits = model((images, tokens))
    logits.retain_grad()
    loss = masked_token_loss(logits, labels, state.tensor_group)
    loss.backward()
    # float64 by hand: log-sum-exp minus the target logit, over text targets
    lg = logits.detach()
    terms = [torch.logsumexp(lg[b, j], 0) - lg[b, j, y]
             for b in range(3) for j, y in enumerate(labels[b].tolist()) if y != IGNORE_INDEX]
    out["loss"], out["ref"] = loss.item(), torch.stack(terms).mean().item()
    ignored = labels == IGNORE_INDEX
    out["grad_ignored"] = float(logits.grad[ignored].abs().max())
    out["grad_counted_min"] = float(logits.grad[~ignored].abs().amax(-1).min())
    per_token = model((images, tokens), labels)
    out["per_token_ignored"] = per_token.detach()[ignored].abs().max().item()
    out["per_token_mean"] = float(per_token.sum() / (~ignored).sum())
    # another image changes the predictions after it, never before it (causal)
    with torch.no_grad():
        other = model((images.roll(1, 0), tokens))
    moved = (other - lg).abs().amax(-1)  # [b, S]
    out["row1_before"] = float(moved[1, :2].max())
    out["row1_after"] = float(moved[1, 2:].min())
    # MegaScope sees the decoder's layers only (the encoder's are not tapped)
    from megatronapp.scope import Scope

    scope = Scope(model)
    scope.watch("residual", reduce="none")
    with torch.no_grad(), scope.step():
        model((images, tokens))
    out["scope"] = {layer: list(t.shape) for layer, t in scope.collect()["residual"].items()}
    return out


def test_image_placement_and_loss_on_text_only():
    r = run_ranks(_placement_and_loss, 1)[0]
    assert max(r["placed"]) == 0.0  # exact: a gather, no arithmetic
    i = -100
    # row 1: "<bos> a <image> b c d <eos>": combined [bos, a, I, I, I, I, I, b, c, d, eos]
    assert r["labels"][1] == [4, i, i, i, i, i, 5, 6, 7, 2, i]
    assert r["labels"][0] == [i, i, i, i, 4, 5, 6, 7, 2, i, i]  # the pad is ignored too
    assert r["labels"][2] == [4, 5, 6, 7, 2, i, i, i, i, i, i]
    assert abs(r["loss"] - r["ref"]) < 1e-12
    assert r["grad_ignored"] == 0.0 and r["grad_counted_min"] > 0.0
    assert r["per_token_ignored"] == 0.0
    assert abs(r["per_token_mean"] - r["ref"]) < 1e-12
    assert r["row1_before"] == 0.0 and r["row1_after"] > 1e-9
    assert r["scope"] == {0: [11, 32], 1: [11, 32]}  # [S, h] of the decoder (sample 0)


def _bad_inputs(rank, world):
    import megatronapp
    from megatronapp.models import GPTConfig, VLMConfig

    state = megatronapp.initialize_model_parallel()
    cfg, model = _small_vlm(state)
    images = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    return error_messages(
        lambda: model((images, torch.tensor([[1, 4, 5, 6, 7, 2, 0]] * 2))),
        lambda: model((images, torch.tensor([[3, 4, 5, 2]] * 2))),
        lambda: VLMConfig(language=GPTConfig(vocab_size=16, hidden_size=32, num_layers=1,
                                             num_attention_heads=4, seq_length=4),
                          vision=cfg.vision))


def test_bad_inputs_get_clear_errors():
    msgs = run_ranks(_bad_inputs, 1)[0]
    assert "exactly one image token (3); counts per row: [0, 0]" in msgs[0]
    assert "expected 7 text tokens per sample" in msgs[1]
    assert "no room for text after the 5 image tokens" in msgs[2]


# ---- the VLM on the training edge (examples/pretrain_vlm.py) -------------------------
# 16x16 images in 4x4 patches: 16 patches + the class token, 10 text tokens
VLM_FLAGS = ["--num-layers", "2", "--encoder-num-layers", "1", "--hidden-size", "32",
             "--num-attention-heads", "4", "--img-h", "16", "--img-w", "16", "--patch-dim", "4",
             "--seq-length", "26", "--micro-batch-size", "4", "--global-batch-size", "16",
             "--lr", "2e-3", "--lr-warmup-iters", "1", "--train-iters", "6", "--eval-iters", "2",
             "--no-progress", "--log-interval", "1000"]


def _train_vlm(rank, world, extra, out, stop_at=None):
    from megatronapp.pretrain_vlm import build_parser
    from megatronapp.training import Hook, train
    from megatronapp.training.vision import AccuracyHook, CaptionHook, VLMTask

    class StopAt(Hook):
        def should_stop(self, run, it):
            return stop_at is not None and it + 1 == stop_at

        def on_model(self, modules, rank):  # the top-level parts on this rank
            self.parts = sorted({n.split(".")[0] for c in modules for n, _ in c.named_parameters()})

    args = build_parser().parse_args(VLM_FLAGS + extra + ["--output-dir", out])
    text_only = args.text_only
    del args.text_only
    hook = StopAt()
    s = train(args, task=VLMTask(text_only=text_only),
              hooks=[hook, AccuracyHook(), CaptionHook(n=16, show=0)])
    return {"losses": s["losses"], "valid": s["valid_loss"], "parameters": s["parameters"],
            "parts": hook.parts, "acc": s["valid_accuracy"], "captions": s.get("captions")}


def _vocab(tp: int) -> list:
    """The 17 caption words padded to 64 rows at any tensor-parallel size (the
    padding rows take part in the softmax, so the sizes must agree)."""
    return ["--make-vocab-size-divisible-by", str(64 // tp)]


@pytest.fixture(scope="module")
def vlm_tp1(tmp_path_factory):
    return run_ranks(_train_vlm, 1, _vocab(1), str(tmp_path_factory.mktemp("vlm1")))[0]


@pytest.mark.parametrize("world,extra", [
    (2, ["--tensor-model-parallel-size", "2"]),
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--disable-vision-class-token"]),
    (2, ["--pipeline-model-parallel-size", "2"]),
    (4, PP2_DP2_ZERO1_ZB),
    (4, PP2_FBD_RECOMPUTE),
], ids=["tp2", "tp2-sp-no-class-token", "pp2", "pp2-dp2-zero1-zb", "fbd"])
def test_vlm_trains_the_same_under_every_layout(tmp_path, vlm_tp1, world, extra):
    want = vlm_tp1
    if "--disable-vision-class-token" in extra:  # a different model: its own TP1 run
        want = run_ranks(_train_vlm, 1, _vocab(1) + ["--disable-vision-class-token"],
                         str(tmp_path / "ref"))[0]
    tp = 2 if "--tensor-model-parallel-size" in extra else 1
    got = run_ranks(_train_vlm, world, _vocab(tp) + extra, str(tmp_path))
    assert got[0]["parameters"] == want["parameters"]
    assert_same_training(got, want, steps=6)
    if extra[0] == "--pipeline-model-parallel-size":  # the encoder is on the first stage
        assert got[0]["parts"] == ["layers", "position_embeddings", "projector", "vision",
                                   "word_embeddings"]
        assert got[-1]["parts"] == ["final_layernorm", "layers", "word_embeddings"]


def test_vlm_bf16_tracks_fp32(tmp_path, vlm_tp1):
    """--bf16 (the images enter the encoder in bf16, fp32 main weights and
    cross-entropy): the fp32 losses within bf16's rounding."""
    got = run_ranks(_train_vlm, 1, _vocab(1) + ["--bf16"], str(tmp_path))[0]
    for g, w in zip(got["losses"], vlm_tp1["losses"], strict=True):
        assert abs(g - w) < 0.03 * w, (got["losses"], vlm_tp1["losses"])


def test_vlm_resume_is_bit_identical(tmp_path):
    pp = ["--pipeline-model-parallel-size", "2"]
    whole = run_ranks(_train_vlm, 2, pp, str(tmp_path / "whole"))[0]["losses"]
    first = run_ranks(_train_vlm, 2, pp + ["--save", str(tmp_path / "ck")], str(tmp_path / "a"),
                      3)[0]["losses"]
    second = run_ranks(_train_vlm, 2, pp + ["--load", str(tmp_path / "ck")],
                       str(tmp_path / "b"))[0]["losses"]
    assert first == whole[:2]
    assert second == whole[3:]


def test_vlm_checkpoint_reshards_across_layouts(tmp_path):
    """Saved by PP2 (the encoder on stage 0 only), loaded by TP2 (the encoder
    and projector split over two tensor ranks): the run continues as the
    uninterrupted PP2 run within 1e-5."""
    pp, tp = _vocab(1) + ["--pipeline-model-parallel-size", "2"], \
        _vocab(2) + ["--tensor-model-parallel-size", "2"]
    whole = run_ranks(_train_vlm, 2, pp, str(tmp_path / "whole"))[0]["losses"]
    run_ranks(_train_vlm, 2, pp + ["--save", str(tmp_path / "ck")], str(tmp_path / "a"), 3)
    second = run_ranks(_train_vlm, 2, tp + ["--load", str(tmp_path / "ck")],
                       str(tmp_path / "b"))[0]["losses"]
    assert len(second) == 3
    for g, w in zip(second, whole[3:], strict=True):
        assert abs(g - w) < 1e-5, (second, whole[3:])


def _config_error(rank, world, extra, out):
    with pytest.raises(SystemExit) as e:
        _train_vlm(rank, world, extra, out)
    return str(e.value)


def test_flags_that_cannot_work_are_refused(tmp_path):
    msg = run_ranks(_config_error, 1, ["--seq-length", "20"], str(tmp_path))[0]
    assert "--seq-length 20 is the decoder's sequence: 17 image tokens and 4 text tokens" in msg
    assert "use --seq-length >= 26" in msg
    msg = run_ranks(_config_error, 1, ["--img-h", "18"], str(tmp_path))[0]
    assert "must be equal" in msg


def test_vlm_uses_the_image(tmp_path):
    """140 steps on 2 ranks each (200 until 2026-12-06; at 140 the margins are
    0.215 nats for 0.15 and 0.104 accuracy for 0.05): the VLM's caption loss on unseen images
    falls below the text-only model's on the same captions (whose floor is
    the captions' entropy, about 0.75 nats per token); the long run is in
    benchmarks/RESULTS.md."""
    flags = ["--tensor-model-parallel-size", "2", "--img-h", "32", "--img-w", "32",
             "--seq-length", "74", "--encoder-num-layers", "2", "--hidden-size", "64",
             "--micro-batch-size", "16", "--global-batch-size", "32", "--lr", "2e-3",
             "--min-lr", "2e-4", "--lr-warmup-iters", "14", "--train-iters", "140"]
    vlm = run_ranks(_train_vlm, 2, flags, str(tmp_path / "vlm"), timeout=400)[0]
    text = run_ranks(_train_vlm, 2, flags + ["--text-only"], str(tmp_path / "text"),
                     timeout=400)[0]
    assert text["valid"] > 0.65  # the text alone cannot name the shapes
    assert vlm["valid"] < text["valid"] - 0.15, (vlm["valid"], text["valid"])
    assert vlm["acc"] > text["acc"] + 0.05, (vlm["acc"], text["acc"])
    # greedy captions of 16 unseen images: well-formed; the text-only model
    # says the same thing whatever the image, the VLM does not
    from megatronapp.data.shapes import COLOURS, SHAPES

    for run in (vlm, text):
        for _, got in run["captions"]:
            w = got.split()
            assert w[0] == "a" and w[1] in COLOURS and w[2] in SHAPES, got
    assert len({got for _, got in text["captions"]}) == 1, text["captions"]
    assert len({got for _, got in vlm["captions"]}) >= 3, vlm["captions"]


def test_a_caption_reads_either_way_round():
    from megatronapp.data.shapes import CaptionData

    assert CaptionData.other_way("a red square left of a blue circle") == \
        "a blue circle right of a red square"
    assert CaptionData.other_way("a green cross above a red triangle") == \
        "a red triangle below a green cross"
