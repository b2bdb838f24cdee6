"""MegaScope end to end: a real headless Chromium (Debian's chromium +
chromium-driver, driven by Selenium) loads the page served by a 2-rank TP2
model restored from a checkpoint, runs a generation, checks that the top-k
table and the heatmap show the values the Python API computes (TP1, same
checkpoint), applies a perturbation and sees the output change, and saves
screenshots. Also: bad requests get JSON errors and a misbehaving client
does not disturb the server."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from dist_harness import free_port, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64"]
PROMPT = "In the beginning"
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def _train_checkpoint(tmp_path) -> str:
    ckpt = str(tmp_path / "ckpt")
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "pretrain_gpt.py"), *MODEL,
                    "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "30",
                    "--lr", "3e-3", "--no-progress", "--log-interval", "10", "--eval-iters", "1",
                    "--save", ckpt, "--output-dir", str(tmp_path / "train")],
                   check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True)
    return ckpt


def _serve(ckpt, tmp_path, world=2):
    port, port_file = free_port(), str(tmp_path / "scope.port")
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        log = open(tmp_path / f"serve{r}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "megatronapp.scope", "serve", "--port", "0", "--port-file",
             port_file, "--checkpoint", ckpt, "--tensor-model-parallel-size", str(world)],
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


def _post(url, body, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _reference(rank, world, ckpt):
    """The Python API on one rank (TP1) from the same checkpoint."""
    import megatronapp
    from megatronapp.checkpoint import load, read_metadata
    from megatronapp.data import build_tokenizer
    from megatronapp.models import GPTConfig, GPTModel
    from megatronapp.scope.session import Session

    state = megatronapp.initialize_model_parallel(tensor_model_parallel_size=1)
    _, meta = read_metadata(ckpt)
    fields = set(GPTConfig.__dataclass_fields__)
    model = GPTModel(GPTConfig(**{k: v for k, v in meta["config"].items() if k in fields}),
                     parallel_state=state)
    load(ckpt, [model], parallel_state=state)
    session = Session(model, build_tokenizer("ByteTokenizer"), state)
    return session.execute({"op": "generate", "prompts": [PROMPT], "max_new_tokens": 6,
                            "top_k": 5, "mode": "slow"})


def _browser():
    from selenium import webdriver

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1400,1200"):
        opts.add_argument(a)
    return webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=DRIVER))


def _wait(driver, script, timeout=120):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = driver.execute_script(script)
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for: {script}; status: "
                         + str(driver.execute_script("return document.getElementById('status')"
                                                     ".textContent")))


def _shot(driver, tmp_path, name):
    path = tmp_path / name
    driver.save_screenshot(str(path))
    out = os.environ.get("MAPP_SCOPE_SCREENSHOTS")  # docs/images: refreshes the docs' pictures
    if out:
        shutil.copy(path, os.path.join(out, name))
    assert path.stat().st_size > 10_000


@pytest.mark.timeout(420)
@pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs Debian's chromium and "
                    "chromium-driver (make setup installs them)")
def test_browser_generation_matches_the_python_api_and_perturbation_changes_it(tmp_path):
    ckpt = _train_checkpoint(tmp_path)
    ref = run_ranks(_reference, 1, ckpt)[0]
    procs, url = _serve(ckpt, tmp_path)
    driver = None
    try:
        driver = _browser()
        driver.get(url + "/")
        _wait(driver, "return document.body.dataset.ready === '1'")
        driver.execute_script(
            f"document.getElementById('prompt').value = {json.dumps(PROMPT)};"
            "document.getElementById('max-new-tokens').value = '6';")
        driver.find_element("id", "generate").click()
        _wait(driver, "return document.body.dataset.generated === '1'")
        # the top-k table: the chosen token's probability and the alternatives
        rows = driver.execute_script(
            "return [...document.querySelectorAll('#topk-table tr[data-step]')].map(r => "
            "[...r.querySelectorAll('td[data-value]')].map(c => "
            "[c.dataset.token ? Number(c.dataset.token) : null, Number(c.dataset.value)]))")
        steps = ref["steps"][0]
        assert len(rows) == len(steps) == 6
        for row, s in zip(rows, steps, strict=True):
            assert abs(row[0][1] - s["prob"]) < 1e-5
            assert [t for t, _ in row[1:]] == [i for i, _, _ in s["topk"]]
            for (_, p), (_, q, _) in zip(row[1:], s["topk"], strict=True):
                assert abs(p - q) < 1e-5
        text = driver.execute_script("return document.getElementById('output').dataset.text")
        assert text == ref["text"][0]
        # the heatmap: attention probabilities of layer 1, head 2 (TP2: rank 1's head)
        driver.execute_script(
            "for (const [id, v] of [['site', 'attn_probs'], ['layer', '1'], ['head', '2']]) {"
            "  const s = document.getElementById(id); s.value = v;"
            "  s.dispatchEvent(new Event('change')); }")
        z = _wait(driver, "const h = document.getElementById('heatmap');"
                          "return h.dataset.head === '2' && h.data && h.data[0].z")
        want = ref["internals"]["attn_probs"]["1"][2]
        assert len(z) == len(want) == len(PROMPT) + 5
        assert max(abs(a - b) for ra, rb in zip(z, want, strict=True)
                   for a, b in zip(ra, rb, strict=True)) < 1e-5
        _shot(driver, tmp_path, "scope-generate.png")
        # perturb the MLP output of layer 0 until cleared: the generation changes
        driver.execute_script(
            "for (const [id, v] of [['p-site', 'mlp_out'], ['p-kind', 'gaussian'], "
            "['p-layer', '0'], ['p-amount', '3.0'], ['p-steps', ''], ['p-seed', '1']]) "
            "document.getElementById(id).value = v;")
        driver.find_element("id", "apply").click()
        _wait(driver, "return document.querySelectorAll('#perturbations li').length === 1")
        driver.find_element("id", "generate").click()
        _wait(driver, "return document.body.dataset.generated === '2'")
        perturbed = driver.execute_script(
            "return document.getElementById('output').dataset.perturbed")
        assert "mlp_out[0]:gaussian(std=3.0" in perturbed
        z2 = driver.execute_script("return document.getElementById('heatmap').data[0].z")
        assert z2 != z
        probs = driver.execute_script(
            "return [...document.querySelectorAll('#topk-table tr[data-step]')].map(r => "
            "Number(r.querySelector('td[data-value]').dataset.value))")
        assert any(abs(a - s["prob"]) > 1e-3 for a, s in zip(probs, steps, strict=True))
        _shot(driver, tmp_path, "scope-perturbed.png")
        assert driver.get_log("browser") == [] or all(
            "favicon" in e["message"] for e in driver.get_log("browser"))
    finally:
        if driver is not None:
            driver.quit()
        _stop(procs)


def _misbehave(host, port):
    """Garbage bytes, a half-sent request and a WebSocket that vanishes."""
    for payload in (b"\x00\xff garbage\r\n\r\n", b"POST /api/generate HTTP/1.1\r\n"
                    b"Content-Length: 100000\r\n\r\n{\"prompt\":"):
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(payload)
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
        s.recv(100)


@pytest.mark.timeout(300)
def test_bad_requests_get_json_errors_and_bad_clients_do_not_disturb_the_server(tmp_path):
    ckpt = _train_checkpoint(tmp_path)
    procs, url = _serve(ckpt, tmp_path)
    try:
        ok, first = _post(url + "/api/generate", {"prompt": PROMPT, "max_new_tokens": 3})
        assert ok == 200, first
        cases = [({"prompt": 5}, "prompt: expected str"),
                 ({"prompt": PROMPT, "max_new_tokens": 10_000}, "max_new_tokens must be in"),
                 ({"prompt": PROMPT, "mode": "turbo"}, "mode 'turbo'"),
                 ({"prompt": ""}, "non-empty strings")]
        for body, msg in cases:
            code, r = _post(url + "/api/generate", body)
            assert code == 400 and msg in r["error"], (body, r)
        code, r = _post(url + "/api/perturb", {"site": "mlp_out", "kind": "gaussian",
                                               "layers": [9]})
        assert code == 400 and "layer must be an integer in [0, 1]" in r["error"], r
        code, r = _post(url + "/api/perturb", {"site": "nope", "kind": "gaussian"})
        assert code == 400 and "unknown perturbation site 'nope'" in r["error"]
        code, r = _post(url + "/api/generate", None, raw=b"{bad json")
        assert code == 400 and "malformed JSON" in r["error"]
        code, r = _post(url + "/api/generate", None, raw=b'{"prompt": "' + b"a" * 100_000 + b'"}')
        assert code == 413 and "larger than" in r["error"]
        host, port = url.removeprefix("http://").split(":")
        _misbehave(host, int(port))
        ok, again = _post(url + "/api/generate", {"prompt": PROMPT, "max_new_tokens": 3})
        assert ok == 200 and again["tokens"] == first["tokens"]
        assert all(p.poll() is None for p in procs)
    finally:
        _stop(procs)
