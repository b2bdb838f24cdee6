"""Generation: the KV-cached, batched engine returns exactly the tokens of a
token-by-token reference (the whole sequence re-run for every token, no
cache, one prompt at a time, one rank) at TP1, TP2, PP2 and TP2 x PP2, for a
Llama block (RoPE, GQA, SwiGLU), a GPT-2 block (learned positions), an
MoE block and a DeepSeek MLA block (YaRN); sampling with a seed is the same at every layout; and the
OpenAI-style server (python -m megatronapp.serve, 2 ranks) answers
concurrent clients with the reference's text, streams it, honours stop
strings and the token, and answers bad requests with JSON errors."""

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from dist_harness import free_port, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMON = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
          "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
          "--lr", "3e-3", "--lr-warmup-iters", "2", "--train-iters", "25", "--eval-iters", "0",
          "--no-progress", "--log-interval", "1000"]
BLOCKS = {
    "llama": ["--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "96",
              "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
              "--disable-bias-linear", "--untie-embeddings-and-output-weights"],
    "gpt": [],
    "moe": ["--position-embedding-type", "rope", "--num-experts", "4", "--moe-router-topk", "2",
            "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"],
    # DeepSeek's attention: the cache holds MLA's up-projected keys and values; YaRN positions
    "mla": ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
            "--ffn-hidden-size", "96", "--untie-embeddings-and-output-weights",
            "--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16",
            "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12",
            "--position-embedding-type", "yarn", "--rotary-interleaved",
            "--yarn-rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "8",
            "--yarn-mscale", "1", "--yarn-mscale-all-dim", "1"],
}
PROMPTS = ["In the beginning God", "And", "And the earth was without form, and void; and"]
MAX_TOKENS = [12, 20, 7]
SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.9, seed=7, max_tokens=16)


def _train(rank, world, flags):
    from megatronapp.pretrain import build_parser, train

    train(build_parser().parse_args(flags))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for name, flags in BLOCKS.items():
        d = tmp_path_factory.mktemp(name)
        run_ranks(_train, 1, COMMON + flags + ["--save", str(d / "ckpt"),
                                               "--output-dir", str(d / "run")])
        out[name] = str(d / "ckpt")
    return out


def _reference(rank, world, ckpt):
    """Token by token, no cache, each prompt alone: the greedy tokens, and
    the sampled ones drawn with choose() from the same seed."""
    import torch
    from megatronapp.data import ByteTokenizer
    from megatronapp.inference import SamplingParams, choose, load_model

    model, _ = load_model(ckpt, 1, 1)
    tok = ByteTokenizer()

    def run(ids, steps, params, gen):
        ids = list(ids)
        out = []
        with torch.no_grad():
            for _ in range(steps):
                logits = model(torch.tensor([ids]))[0, -1].float()
                logits[tok.vocab_size:] = float("-inf")
                t, _ = choose(logits, params, gen)
                out.append(t)
                ids.append(t)
        return out

    greedy = [run(tok.tokenize(p), n, SamplingParams(temperature=0.0), None)
              for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    sp = SamplingParams(**SAMPLED)
    sampled = run(tok.tokenize(PROMPTS[0]), sp.max_tokens, sp,
                  torch.Generator().manual_seed(sp.seed))
    return greedy, sampled


def _engine(rank, world, ckpt, tp, pp):
    from megatronapp.data import ByteTokenizer
    from megatronapp.inference import InferenceEngine, SamplingParams, load_model

    model, state = load_model(ckpt, tp, pp)
    tok = ByteTokenizer()
    eng = InferenceEngine(model, state, vocab=tok.vocab_size, eod=None)
    streamed = []
    # one batch: three greedy prompts of different lengths (left padding) and a sampled one
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in MAX_TOKENS] + [
        SamplingParams(**SAMPLED)]
    prompts = [tok.tokenize(p) for p in PROMPTS] + [tok.tokenize(PROMPTS[0])]
    out = eng.generate(prompts, params, lambda i, t, lp, r: streamed.append((i, t, r)))
    return ([o["tokens"] for o in out], [o["finish_reason"] for o in out],
            [o["logprobs"] for o in out], streamed)


def _engine_joining(rank, world, ckpt, tp, pp):
    """Continuous batching: one short prompt starts; at admit()'s 2nd call a
    greedy and a sampled prompt join, at its 5th the longest one (longer than
    the columns filled so far: the cache is widened on the left); once it
    ends, the columns only it used are dropped (trim_left)."""
    from megatronapp.data import ByteTokenizer
    from megatronapp.inference import InferenceEngine, SamplingParams, load_model

    model, state = load_model(ckpt, tp, pp)
    tok = ByteTokenizer()
    eng = InferenceEngine(model, state, vocab=tok.vocab_size, eod=None)
    greedy = [SamplingParams(temperature=0.0, max_tokens=n) for n in MAX_TOKENS]
    arrivals = {2: ([tok.tokenize(PROMPTS[0]), tok.tokenize(PROMPTS[0])],
                    [greedy[0], SamplingParams(**SAMPLED)]),
                5: ([tok.tokenize(PROMPTS[2])], [greedy[2]])}
    calls, active = [0], []

    def admit(n):
        calls[0] += 1
        active.append(n)
        return arrivals.get(calls[0], ([], []))
    from megatronapp.models import kv_cache

    trims, trim = [], kv_cache.KVCache.trim_left

    def counted(cache):
        trims.append(trim(cache))
        return trims[-1]
    kv_cache.KVCache.trim_left = counted
    try:
        out = eng.generate([tok.tokenize(PROMPTS[1])], [greedy[1]], admit=admit)
    finally:
        kv_cache.KVCache.trim_left = trim
    return [o["tokens"] for o in out], [o["finish_reason"] for o in out], active, trims


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_requests_joining_a_running_batch_get_the_references_tokens(ckpts, references, tp, pp):
    greedy, sampled = references["llama"]
    for tokens, reasons, active, trims in run_ranks(_engine_joining, tp * pp, ckpts["llama"],
                                                    tp, pp):
        assert tokens == [greedy[1], greedy[0], sampled, greedy[2]], tokens
        assert reasons == ["length"] * 4
        # admit() runs after each decoding step: 1 sequence, 3 once the first arrivals
        # joined (at its 2nd call), 4 once the long prompt did (at its 5th)
        assert active[:7] == [1, 1, 3, 3, 3, 4, 4], active
        # the longest prompt starts at column 0 and ends first: its columns are dropped
        assert sum(trims) > 0 and trims[:5] == [0] * 5, trims


@pytest.fixture(scope="module")
def references(ckpts):
    return {name: run_ranks(_reference, 1, path)[0] for name, path in ckpts.items()}


@pytest.mark.parametrize("block,tp,pp", [
    ("llama", 1, 1), ("llama", 2, 1), ("llama", 1, 2), ("llama", 2, 2), ("gpt", 2, 1),
    ("gpt", 1, 2), ("moe", 2, 1), ("mla", 2, 1), ("mla", 1, 2),
], ids=["llama-tp1", "llama-tp2", "llama-pp2", "llama-tp2-pp2", "gpt-tp2", "gpt-pp2",
        "moe-tp2", "mla-tp2", "mla-pp2"])
def test_cached_batched_generation_returns_the_references_tokens(ckpts, references, block, tp,
                                                                 pp):
    greedy, sampled = references[block]
    results = run_ranks(_engine, tp * pp, ckpts[block], tp, pp)
    for tokens, reasons, logprobs, streamed in results:  # every rank holds the same result
        assert tokens[:3] == greedy, (tokens[:3], greedy)
        assert tokens[3] == sampled, (tokens[3], sampled)
        assert reasons == ["length"] * 4
        assert [len(lp) for lp in logprobs] == [len(t) for t in tokens]
        assert all(lp <= 0.0 for row in logprobs for lp in row)
        # every token was handed on as it was chosen, the last one with its reason
        for i, row in enumerate(tokens):
            mine = [(t, r) for j, t, r in streamed if j == i]
            assert [t for t, _ in mine] == row and mine[-1][1] == "length"
            assert all(r is None for _, r in mine[:-1])
    assert len({json.dumps(r[0]) for r in results}) == 1


def test_sampling_follows_its_definition():
    """choose(): greedy is the argmax; top-k keeps k tokens; top-p the
    smallest set reaching p; the draws follow the renormalized
    probabilities (a chi-square bound over 4000 draws)."""
    import torch
    from megatronapp.inference import SamplingParams, choose

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    assert choose(logits, SamplingParams(temperature=0.0), None)[0] == 0
    g = torch.Generator().manual_seed(0)

    def freq(params, n=4000):
        counts = torch.zeros(6)
        for _ in range(n):
            counts[choose(logits, params, g)[0]] += 1
        return counts / n

    def expected(keep, temperature=1.0):
        p = torch.softmax(logits / temperature, -1)
        p[[i for i in range(6) if i not in keep]] = 0
        return p / p.sum()

    probs = torch.softmax(logits, -1)
    # top-p 0.8: the sorted cumulative mass reaches 0.8 at the third token
    assert float(probs[:2].sum()) < 0.8 <= float(probs[:3].sum())
    for params, keep in ((SamplingParams(top_k=2), [0, 1]),
                         (SamplingParams(top_p=0.8), [0, 1, 2]),
                         (SamplingParams(temperature=0.5), list(range(6)))):
        want = expected(keep, params.temperature)
        got = freq(params)
        assert set(torch.nonzero(got).flatten().tolist()) <= set(keep)
        chi2 = float(((got - want) ** 2 / want.clamp(min=1e-9))[want > 0].sum() * 4000)
        assert chi2 < 25.0, (params, got, want)  # ~1e-4 tail for <= 5 degrees of freedom
    token, logprob = choose(logits, SamplingParams(top_k=1), g)
    assert token == 0 and abs(logprob - float(torch.log_softmax(logits, -1)[0])) < 1e-6


# ---- the server ------------------------------------------------------------------

TOKEN = "s3cret"


def _serve(ckpt, tmp_path, world=2, extra=()):
    port, port_file = free_port(), str(tmp_path / "serve.port")
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        log = open(tmp_path / f"serve{r}.log", "w")  # noqa: SIM115 - the process's
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "megatronapp.serve", "--load", ckpt, "--port", "0",
             "--port-file", port_file, "--tensor-model-parallel-size", str(world),
             "--model-name", "tiny", "--token", TOKEN, "--seq-length", "64", *extra],
            env=env, stdout=log, stderr=log))
    t0 = time.monotonic()
    while not os.path.exists(port_file):
        if time.monotonic() - t0 > 120 or any(p.poll() is not None for p in procs):
            _stop(procs)
            raise AssertionError((tmp_path / "serve0.log").read_text()[-3000:])
        time.sleep(0.2)
    return procs, f"http://127.0.0.1:{open(port_file).read()}"


def _stop(procs):
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


def _call(url, body=None, raw=None, token=TOKEN, method=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_server_answers_concurrent_clients_with_the_references_text(ckpts, references,
                                                                    tmp_path):
    from megatronapp.data import ByteTokenizer

    tok = ByteTokenizer()
    greedy, _ = references["llama"]
    texts = [tok.detokenize(t) for t in greedy]
    procs, url = _serve(ckpts["llama"], tmp_path, extra=["--max-request-bytes", "4096"])
    try:
        api = url + "/v1/completions"
        # eight clients at once, each prompt twice: batched together, each gets its text
        replies = {}

        def client(k):
            i = k % 3
            replies[k] = _call(api, {"model": "tiny", "prompt": PROMPTS[i],
                                     "max_tokens": MAX_TOKENS[i], "temperature": 0})
        threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        for k, (status, body) in replies.items():
            assert status == 200, body
            reply = json.loads(body)
            i = k % 3
            assert reply["object"] == "text_completion" and reply["model"] == "tiny"
            choice = reply["choices"][0]
            assert choice["text"] == texts[i] and choice["finish_reason"] == "length"
            assert reply["usage"] == {"prompt_tokens": len(PROMPTS[i].encode()),
                                      "completion_tokens": MAX_TOKENS[i],
                                      "total_tokens": len(PROMPTS[i].encode()) + MAX_TOKENS[i]}
        assert len(replies) == 8

        # a list of prompts: one choice each; logprobs 0: the chosen tokens'
        status, body = _call(api, {"prompt": PROMPTS[:2], "max_tokens": 5, "temperature": 0,
                                   "logprobs": 0})
        choices = json.loads(body)["choices"]
        assert status == 200 and [c["index"] for c in choices] == [0, 1]
        assert [c["text"] for c in choices] == [tok.detokenize(g[:5]) for g in greedy[:2]]
        assert all(len(c["logprobs"]["token_logprobs"]) == 5 for c in choices)

        # streaming: the pieces make the text, then [DONE]
        status, body = _call(api, {"prompt": PROMPTS[2], "max_tokens": MAX_TOKENS[2],
                                   "temperature": 0, "stream": True})
        events = [line[6:] for line in body.split("\n\n") if line.startswith("data: ")]
        assert status == 200 and events[-1] == "[DONE]", body
        pieces = [json.loads(e)["choices"][0] for e in events[:-1]]
        assert "".join(p["text"] for p in pieces) == texts[2]
        assert pieces[-1]["finish_reason"] == "length"
        assert all(p["finish_reason"] is None for p in pieces[:-1])

        # a stop string: the text ends before it, finish_reason "stop"
        stop = texts[1][4:6]
        status, body = _call(api, {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS[1],
                                   "temperature": 0, "stop": [stop]})
        choice = json.loads(body)["choices"][0]
        assert choice == {"text": texts[1][:texts[1].find(stop)], "index": 0,
                          "finish_reason": "stop", "logprobs": None}, (choice, stop)
        status, body = _call(api, {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS[1],
                                   "temperature": 0, "stop": stop, "stream": True})
        events = [line[6:] for line in body.split("\n\n") if line.startswith("data: ")]
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == \
            texts[1][:texts[1].find(stop)]

        # a seed gives the same sampled text twice
        twice = [json.loads(_call(api, {"prompt": PROMPTS[0], **SAMPLED})[1])["choices"][0]
                 for _ in range(2)]
        assert twice[0]["text"] == twice[1]["text"] == tok.detokenize(references["llama"][1])

        status, body = _call(url + "/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny"

        # bad requests: JSON errors naming what is wrong; the server goes on
        def error(status_want, *args, **kw):
            status, body = _call(*args, **kw)
            assert status == status_want, (status, body)
            return json.loads(body)["error"]
        assert "token" in error(401, api, {"prompt": "x"}, token=None)["message"]
        assert "malformed JSON" in error(400, api, raw=b"{nope")["message"]
        e = error(400, api, {"prompt": "x", "max_token": 3})
        assert "max_token" in e["message"] and e["param"] == "max_token"
        e = error(400, api, {"prompt": "x", "max_tokens": 64})
        assert e["param"] == "max_tokens" and "the model's seq_length is 64" in e["message"]
        assert "prompt" in error(400, api, {"prompt": ""})["message"]
        assert "prompt" in error(400, api, {"prompt": [1, 99999]})["message"]
        assert "temperature" in error(400, api, {"prompt": "x", "temperature": "hot"})["message"]
        assert "n: only 1" in error(400, api, {"prompt": "x", "n": 2})["message"]
        assert "not served here" in error(404, api, {"prompt": "x", "model": "gpt-9"})["message"]
        assert "larger than 4096 bytes" in error(413, api, {"prompt": "x" * 5000})["message"]
        error(404, url + "/v2/nothing")
        status, body = _call(api, {"prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0})
        assert status == 200 and json.loads(body)["choices"][0]["text"] == texts[1][:3]
    finally:
        _stop(procs)


def _layout(rank, world, ckpt, tp, pp, seq_length=None):
    from megatronapp.inference import load_model

    try:
        load_model(ckpt, tp, pp, seq_length=seq_length)
    except ValueError as e:
        return str(e)


def test_server_refuses_an_exposed_address_without_a_token_and_bad_layouts(ckpts):
    from megatronapp.inference import load_model
    from megatronapp.serve.__main__ import build_parser, serve

    with pytest.raises(SystemExit, match="give --token T"):
        serve(build_parser().parse_args(["--load", ckpts["llama"], "--host", "0.0.0.0"]))

    assert "launch 4 ranks" in run_ranks(_layout, 2, ckpts["llama"], 2, 2)[0]
    # (checked before any collective: here, in the test's process)
    with pytest.raises(ValueError, match="do not split evenly over "
                                         "--pipeline-model-parallel-size 3"):
        load_model(ckpts["llama"], 1, 3)
    with pytest.raises(ValueError, match="learned position table has 64 rows"):
        load_model(ckpts["gpt"], seq_length=65)
    with pytest.raises(ValueError, match="no checkpoint there"):
        load_model("/nonexistent/ckpt")
