// MegaScope page: plain ES module + the plotly.js bundled in the plotly wheel.
const $ = (id) => document.getElementById(id);
const token = new URLSearchParams(location.search).get("token");
const auth = token ? { Authorization: `Bearer ${token}` } : {};
const state = { info: null, result: null, loss: { x: [], y: [], perturbed: [] } };

async function api(op, body) {
  const r = await fetch(`/api/${op}`, {
    method: "POST", headers: { "Content-Type": "application/json", ...auth },
    body: JSON.stringify(body || {}),
  });
  const data = await r.json();
  if (data.error) throw new Error(data.error);
  return data;
}

function fillSelect(sel, values, labels) {
  sel.innerHTML = "";
  values.forEach((v, i) => {
    const o = document.createElement("option");
    o.value = v; o.textContent = labels ? labels[i] : v;
    sel.appendChild(o);
  });
}

function showPerturbations(list) {
  const ul = $("perturbations");
  ul.innerHTML = "";
  for (const p of list) { const li = document.createElement("li"); li.textContent = p; ul.appendChild(li); }
}

function escapeText(t) { return JSON.stringify(t).slice(1, -1); }

function renderTopk(res) {
  const table = $("topk-table");
  table.innerHTML = "";
  const steps = res.steps[0];
  const head = table.insertRow();
  ["step", "chosen", "p", ...steps[0].topk.map((_, i) => `#${i + 1}`)].forEach((h) => {
    const th = document.createElement("th"); th.textContent = h; head.appendChild(th);
  });
  steps.forEach((s, i) => {
    const row = table.insertRow();
    row.dataset.step = i;
    row.insertCell().textContent = i;
    row.insertCell().textContent = escapeText(s.text);
    const pc = row.insertCell(); pc.textContent = s.prob.toFixed(6); pc.dataset.value = s.prob;
    for (const [id, p, text] of s.topk) {
      const c = row.insertCell();
      c.textContent = `${escapeText(text)} ${p.toFixed(4)}`;
      c.dataset.token = id; c.dataset.value = p;
      if (id === s.token) c.className = "chosen";
    }
  });
}

function matrixOf(site, layer, head) {
  const v = state.result.internals[site][layer];
  const headed = ["query", "key", "value", "attn_probs", "attn_context"].includes(site);
  return headed ? v[head] : v;
}

function renderHeatmap() {
  const res = state.result;
  if (!res) return;
  const site = $("site").value, layer = $("layer").value, head = Number($("head").value || 0);
  if (!res.internals[site] || !res.internals[site][layer]) return;
  const z = matrixOf(site, layer, head);
  const labels = res.token_text[0].slice(0, z.length).map((t, i) => `${i}:${escapeText(t)}`);
  Plotly.react("heatmap", [{ z, type: "heatmap", colorscale: "Viridis", y: labels }],
    { margin: { t: 10, l: 80 }, yaxis: { autorange: "reversed" } });
  $("heatmap").dataset.site = site; $("heatmap").dataset.layer = layer; $("heatmap").dataset.head = head;
}

function renderPca() {
  const res = state.result;
  const layer = $("layer").value;
  const pts = res.pca[layer];
  if (!pts) return;
  const text = res.token_text[0].slice(0, pts.length).map(escapeText);
  Plotly.react("pca", [{ x: pts.map((p) => p[0]), y: pts.map((p) => p[1]), text, mode: "markers+text",
    type: "scatter", textposition: "top center" }], { margin: { t: 10 } });
}

function renderOutput(res) {
  const out = $("output");
  out.innerHTML = "";
  const toks = res.token_text[0];
  const nGen = res.steps[0].length;
  toks.forEach((t, i) => {
    const span = document.createElement("span");
    span.textContent = t;
    if (i >= toks.length - nGen) span.className = "gen";
    out.appendChild(span);
  });
  out.dataset.text = res.text[0];
  out.dataset.perturbed = res.perturbed || "";
}

async function generate() {
  $("status").textContent = "generating…";
  try {
    const res = await api("generate", {
      prompt: $("prompt").value, max_new_tokens: Number($("max-new-tokens").value),
      top_k: Number($("top-k").value), mode: $("mode").value, sample: $("sample").checked,
    });
    state.result = res;
    renderOutput(res); renderTopk(res);
    const site = $("site").value || "attn_probs";
    fillSelect($("site"), Object.keys(res.internals));
    $("site").value = Object.keys(res.internals).includes(site) ? site : "attn_probs";
    renderHeatmap(); renderPca();
    $("status").textContent = "";
    document.body.dataset.generated = String(Number(document.body.dataset.generated || 0) + 1);
  } catch (e) { $("status").textContent = e.message; }
}

async function applyPerturbation() {
  const kind = $("p-kind").value, amount = Number($("p-amount").value);
  const body = { site: $("p-site").value, kind, layers: [Number($("p-layer").value)],
    seed: Number($("p-seed").value), steps: $("p-steps").value ? Number($("p-steps").value) : null };
  if (kind === "gaussian") body.std = amount;
  if (kind === "uniform") body.scale = amount;
  if (kind === "bitflip") { body.bit = Number($("p-bit").value); body.fraction = Math.min(amount, 1); }
  if (kind === "zero_head") body.head = Number($("p-head").value);
  if (body.site === "weights") { body.name = $("p-name").value; delete body.layers; }
  try { showPerturbations((await api("perturb", body)).perturbations); $("status").textContent = ""; }
  catch (e) { $("status").textContent = e.message; }
}

function connectStream() {
  const ws = new WebSocket(`${location.origin.replace("http", "ws")}/ws${token ? `?token=${token}` : ""}`);
  ws.onmessage = (ev) => {
    const m = JSON.parse(ev.data);
    if (m.type !== "step") return;
    const L = state.loss;
    L.x.push(m.iteration); L.y.push(m.loss); L.perturbed.push(m.perturbed || "");
    Plotly.react("loss", [{ x: L.x, y: L.y, type: "scatter", mode: "lines+markers",
      marker: { color: L.perturbed.map((p) => (p ? "#d62728" : "#1f77b4")) }, text: L.perturbed }],
      { margin: { t: 10 }, xaxis: { title: "iteration" }, yaxis: { title: "loss" } });
  };
}

async function init() {
  const r = await fetch("/api/info", { headers: auth });
  const info = await r.json();
  state.info = info;
  const m = info.model;
  $("model-info").textContent = `${m.num_layers} layers, hidden ${m.hidden_size}, ${m.num_attention_heads} heads` +
    ` · tp ${info.parallel.tp} · ${info.parallel.world} ranks`;
  const layers = [...Array(m.num_layers + 1).keys()].map(String);
  fillSelect($("layer"), layers);
  fillSelect($("head"), [...Array(m.num_attention_heads).keys()].map(String));
  fillSelect($("p-site"), info.perturb_sites);
  fillSelect($("p-kind"), info.kinds);
  showPerturbations(info.perturbations);
  for (const id of ["site", "layer", "head"]) $(id).addEventListener("change", () => { renderHeatmap(); renderPca(); });
  $("generate").addEventListener("click", generate);
  $("apply").addEventListener("click", applyPerturbation);
  $("clear").addEventListener("click", async () => showPerturbations((await api("clear")).perturbations));
  connectStream();
  document.body.dataset.ready = "1";
}

init();
