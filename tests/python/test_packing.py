"""Packed documents (--reset-position-ids --reset-attention-mask
--eod-mask-loss --calculate-per-token-loss): the masks and positions are
Megatron-LM's (get_ltor_masks_and_position_ids, transcribed here); a packed
sequence computes what each document computes alone; training with them is
the same at every layout (TP, SP, PP, DP + ZeRO-1, CP ring and all-to-all,
recomputation) as on one rank."""

import os

import pytest

import torch
from dist_harness import error_messages, run_ranks

EOD = 0


def _megatron_masks(data, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Megatron-LM's get_ltor_masks_and_position_ids (a mask True where
    attention is allowed, the reverse of Megatron's)."""
    b, s = data.shape
    allowed = torch.tril(torch.ones(s, s, dtype=torch.bool)).repeat(b, 1, 1)
    loss_mask = torch.ones(data.shape)
    if eod_mask_loss:
        loss_mask[data == eod] = 0.0
    position_ids = torch.arange(s).unsqueeze(0).repeat(b, 1)
    for i in range(b):
        eods = (data[i] == eod).nonzero().flatten().tolist()
        prev = 0
        for j in eods:
            if reset_attention_mask:
                allowed[i, j + 1:, :j + 1] = False
            if reset_position_ids:
                position_ids[i, j + 1:] -= j + 1 - prev
                prev = j + 1
    return allowed, loss_mask, position_ids


def test_masks_and_positions_are_megatrons():
    from megatronapp import packed_sequence as ps

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 6, (4, 40), generator=g)  # EOD (0) about one token in six
    data[0, -1] = EOD  # a document ending on the last token
    allowed, lmask, pos = _megatron_masks(data, EOD, True, True, True)
    seg = ps.document_ids(data, EOD)
    idx = torch.arange(40)
    assert torch.equal(ps.attention_mask(seg, idx, idx)[:, 0], allowed)
    assert torch.equal(ps.reset_positions(data, EOD), pos)
    assert torch.equal(ps.loss_mask(data, EOD), lmask)


def _alone_vs_packed(rank, world, family):
    """The logits of each document alone and of the same documents packed
    into one sequence (float64, one rank)."""
    import megatronapp as mapp
    from megatronapp import packed_sequence as ps
    from megatronapp.models import GPTConfig, GPTModel

    mapp.initialize_model_parallel(1, 1)
    try:
        kw = dict(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                  seq_length=24)
        if family == "llama":
            kw.update(normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                      position_embedding_type="rope", num_query_groups=2)
        model = GPTModel(GPTConfig(**kw)).double().eval()
        g = torch.Generator().manual_seed(3)
        docs = [torch.randint(1, 64, (n,), generator=g) for n in (7, 11, 6)]
        for d in docs:
            d[-1] = EOD
        packed = torch.cat(docs).unsqueeze(0)  # 24 tokens
        info = ps.PackedSeq(segment_ids=ps.document_ids(packed, EOD),
                            position_ids=ps.reset_positions(packed, EOD))
        with torch.no_grad():
            together = model(packed, packed=info)[0]
            alone = torch.cat([model(d.unsqueeze(0))[0] for d in docs])
            crossing = model(packed)[0]  # without the documents: attention crosses them
        return (together - alone).abs().max().item(), (crossing - alone).abs().max().item()
    finally:
        mapp.destroy_model_parallel()


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_packed_sequence_computes_what_each_document_does_alone(family):
    err, crossing = run_ranks(_alone_vs_packed, 1, family)[0]
    assert err < 1e-12, err
    assert crossing > 1e-3  # the reference is not trivially met


FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "3e-3", "--lr-warmup-iters", "2", "--train-iters", "4", "--eval-iters", "1",
         "--no-progress", "--log-interval", "1000", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--position-embedding-type", "rope", "--attention-backend",
         "unfused"]
PACKED = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Short documents, each ended by NUL (the byte tokenizer's EOD)."""
    g = torch.Generator().manual_seed(5)
    words = ["the", "word", "was", "in", "beginning", "and", "light", "said", "let", "there"]
    docs = []
    for _ in range(400):
        n = int(torch.randint(2, 9, (1,), generator=g))
        docs.append(" ".join(words[int(i)] for i in torch.randint(0, 10, (n,), generator=g)))
    path = tmp_path_factory.mktemp("packed") / "docs.txt"
    path.write_bytes("\x00".join(docs).encode() + b"\x00")
    return str(path)


def _train(rank, world, flags, out_dir):
    from megatronapp.pretrain import build_parser, train

    return train(build_parser().parse_args(FLAGS + flags + ["--output-dir", out_dir]))["losses"]


LAYOUTS = [
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    (2, ["--context-parallel-size", "2"]),
    (4, ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--tensor-model-parallel-size",
         "2"]),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zero-bubble",
         "--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "1"]),
    (4, ["--use-distributed-optimizer", "--context-parallel-size", "2",
         "--attention-backend", "auto"]),
]


@pytest.mark.parametrize("per_token", [False, True])
def test_packed_training_is_the_same_at_every_layout(corpus, tmp_path, per_token):
    """Every layout with the mean of microbatch means; the per-token mean
    (only the loss divisor changes) where ranks hold parts of the tokens: the
    context ring, and data-parallel ZeRO-1 over the context pair."""
    extra = PACKED + ["--data-path", corpus] + (["--calculate-per-token-loss"] if per_token
                                                 else [])
    one = run_ranks(_train, 1, extra, str(tmp_path / "one"))[0]
    plain = run_ranks(_train, 1, ["--data-path", corpus], str(tmp_path / "plain"))[0]
    assert one[-1] < one[0] and all(a != b for a, b in zip(one, plain, strict=True))
    for world, flags in (LAYOUTS[1::3] if per_token else LAYOUTS):
        for losses in run_ranks(_train, world, extra + flags, str(tmp_path / "_".join(flags))):
            assert all(abs(a - b) < 1e-5 for a, b in zip(losses, one, strict=True)), (
                flags, losses, one)


def test_per_token_loss_weights_every_token_once(corpus, tmp_path):
    """After two steps (the losses of fresh weights are all about ln 256), the
    third iteration's reported loss is, by hand from the same weights and
    batch: the mean of the four microbatches' unmasked-token means, or with
    --calculate-per-token-loss the mean over every unmasked token."""
    flags = PACKED + ["--data-path", corpus, "--train-iters", "3", "--lr", "2e-2"]
    for per_token in (False, True):
        mode = flags + (["--calculate-per-token-loss"] if per_token else [])
        losses, ref = run_ranks(_with_reference, 1, mode, str(tmp_path / str(per_token)))[0]
        want = ref["per_token"] if per_token else ref["mean_of_means"]
        assert abs(losses[2] - want) < 1e-5, (per_token, losses, ref)
        assert abs(ref["per_token"] - ref["mean_of_means"]) > 1e-4, ref  # they differ


def _with_reference(rank, world, flags, out_dir):
    """The run's losses, and iteration 3's loss averaged both ways by hand
    from the weights and batch it starts with."""
    from megatronapp import packed_sequence as ps
    from megatronapp.pretrain import build_parser, train
    from megatronapp.training import Hook

    ref = {}

    class Probe(Hook):
        def on_iteration_begin(self, run, it):
            if it != 2:
                return
            cfg = run.config
            tokens, labels = run.dataset.global_batch("train", it, 8, cfg.optim.seed,
                                                      first_sample=it * 8)
            info = ps.PackedSeq(segment_ids=ps.document_ids(tokens, EOD),
                                position_ids=ps.reset_positions(tokens, EOD))
            with torch.no_grad():
                ce = run.chunks[0](tokens, labels, packed=info).double()  # [b, s]
            mask = ps.loss_mask(tokens, EOD).double()
            means = [float((ce[i:i + 2] * mask[i:i + 2]).sum() / mask[i:i + 2].sum())
                     for i in range(0, 8, 2)]  # the four microbatches of 2 samples
            ref.update(mean_of_means=sum(means) / 4,
                       per_token=float((ce * mask).sum() / mask.sum()))

    s = train(build_parser().parse_args(FLAGS + flags + ["--output-dir", out_dir]),
              hooks=[Probe()])
    return s["losses"], ref


def test_packing_flags_that_cannot_run_are_named(corpus):
    from megatronapp.pretrain import build_parser
    from megatronapp.training import Config, ConfigError

    def check(extra, world=1):
        Config.from_args(build_parser().parse_args(FLAGS + PACKED + extra)).check(world)

    msgs = error_messages(lambda: check(["--forward-backward-disaggregating",
                                         "--pipeline-model-parallel-size", "2"], 6),
                          exc=ConfigError)
    assert "do not run with --forward-backward-disaggregating yet" in msgs[0]
    assert os.path.exists(corpus)


# ---- multi-token prediction over packed documents -------------------------------------
def test_mtp_targets_stop_at_a_documents_end():
    from megatronapp import packed_sequence as ps
    from megatronapp.models.mtp import mtp_targets

    x = torch.tensor([[5, 6, EOD, 7, 8, 9]])  # a, b, EOD | c, d, e
    y = torch.tensor([[6, EOD, 7, 8, 9, 4]])  # the labels: ... e -> f
    docs = ps.document_ids(torch.cat([x, y[:, -1:]], 1), EOD)  # 0 0 0 1 1 1 1
    (ids1, tgt1, keep1, div1), (ids2, tgt2, keep2, div2) = mtp_targets(y, 2, documents=docs)
    assert ids1.tolist() == y.tolist() and tgt1.tolist() == [[EOD, 7, 8, 9, 4, 6]]
    # depth 1 at i predicts t_{i+2}: not across the EOD, not past the end
    assert keep1.int().tolist() == [[1, 0, 0, 1, 1, 0]] and div1 == 3.0
    assert keep2.int().tolist() == [[0, 0, 0, 1, 0, 0]] and div2 == 1.0
    # without documents: only the ends of the sequence
    (_, _, k, d), = mtp_targets(y, 1)
    assert k.int().tolist() == [[1, 1, 1, 1, 1, 0]] and d == 5


def _mtp_alone_vs_packed(rank, world):
    """The MTP loss of three documents packed in one sequence against the
    same documents run one by one (float64 layers, one rank), summed over
    the targets each keeps; and against the packed sequence without its
    documents."""
    import megatronapp as mapp
    from megatronapp import packed_sequence as ps
    from megatronapp.models import GPTConfig, GPTModel
    from megatronapp.models.mtp import mtp_loss, mtp_targets

    mapp.initialize_model_parallel(1, 1)
    try:
        model = GPTModel(GPTConfig(
            vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, seq_length=32,
            normalization="RMSNorm", swiglu=True, add_bias_linear=False,
            position_embedding_type="rope", mtp_num_layers=2)).double()
        g = torch.Generator().manual_seed(4)
        docs = [torch.randint(1, 64, (n,), generator=g) for n in (7, 11, 6)]
        for d in docs:
            d[-1] = EOD
        nxt = torch.tensor([9])  # the token after the window

        def total(tokens, after, apart=True):
            labels = torch.cat([tokens[1:], after]).unsqueeze(0)
            x = tokens.unsqueeze(0)
            info = ps.PackedSeq(segment_ids=ps.document_ids(x, EOD),
                                position_ids=ps.reset_positions(x, EOD)) if apart else None
            targets = mtp_targets(labels, 2, documents=ps.document_ids(
                torch.cat([x, labels[:, -1:]], 1), EOD) if apart else None)
            model(x, packed=info)
            with ps.active(info):
                _, parts = mtp_loss(model, model.take_mtp_hidden(), labels, targets)
            return torch.stack([p * t[3] for p, t in zip(parts, targets, strict=True)])
        packed = total(torch.cat(docs), nxt)
        alone = sum(total(d, nxt) for d in docs)
        crossing = total(torch.cat(docs), nxt, apart=False)
        return ((packed - alone).abs().max().item(), (packed - crossing).abs().min().item(),
                packed.abs().min().item())
    finally:
        mapp.destroy_model_parallel()


def test_mtp_over_packed_documents_is_each_documents_alone():
    err, crossing, size = run_ranks(_mtp_alone_vs_packed, 1)[0]
    # (float64 layers; the cross-entropy runs in float32, as in training)
    assert err < 1e-6 * size and size > 1.0, (err, size)
    assert crossing > 1.0, crossing  # without the documents the sums differ


def test_mtp_with_packing_is_the_same_at_every_layout(corpus, tmp_path):
    extra = PACKED + ["--data-path", corpus, "--mtp-num-layers", "1"]
    one = run_ranks(_train, 1, extra, str(tmp_path / "one"))[0]
    no_mtp = run_ranks(_train, 1, PACKED + ["--data-path", corpus], str(tmp_path / "no"))[0]
    assert one[0] == no_mtp[0] and one[1:] != no_mtp[1:]  # MTP trains through the gradient
    for world, flags in (LAYOUTS[0], LAYOUTS[1]):
        for losses in run_ranks(_train, world, extra + flags, str(tmp_path / "_".join(flags))):
            assert all(abs(a - b) < 1e-5 for a, b in zip(losses, one, strict=True)), (
                flags, losses, one)
