// radixserve dashboard: polls /dashboard/stats and draws it. No library, no build step.
// Text from the server (tree labels) only ever goes through textContent.
"use strict";

const POLL_MS = 1000;
const HISTORY = 180; // points kept per chart (3 minutes at one poll a second)
const SVG_NS = "http://www.w3.org/2000/svg";
const history = { tokIn: [], tokOut: [], hit: [], running: [], waiting: [] };

const $ = (id) => document.getElementById(id);

function fmtInt(n) {
  return n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US");
}
function fmtRate(n) {
  if (n === null || n === undefined) return "–";
  return n >= 100 ? fmtInt(n) : n.toFixed(1);
}
function fmtPct(x) {
  return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%";
}
function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  return s < 1 ? (1000 * s).toFixed(1) + " ms" : s.toFixed(2) + " s";
}
function setText(id, text) {
  $(id).textContent = text;
}

// ---- tiles and bars ----------------------------------------------------------------

function renderTiles(s) {
  setText("running", fmtInt(s.requests.running));
  setText("waiting", fmtInt(s.requests.waiting));
  setText("hit-rate-minute", fmtPct(s.cache.hit_rate_last_minute));
  setText("hit-rate-total", fmtPct(s.cache.hit_rate_since_start));
  const t = s.throughput;
  setText("tok-in", t ? fmtRate(t.input_tokens_per_s) : "–");
  setText("tok-out", t ? fmtRate(t.output_tokens_per_s) : "–");
  const p = s.pressure;
  setText("retractions", `${fmtInt(p.retractions_last_minute)} / ${fmtInt(p.retractions)}`);
  setText("evictions", `${fmtInt(p.evicted_pages_last_minute)} / ${fmtInt(p.evicted_pages)}`);
  const spec = s.speculative;
  $("spec-tile").hidden = !spec;
  if (spec) {
    const len = spec.accept_length ? ` (${spec.accept_length.toFixed(2)} tok/step)` : "";
    setText("spec-accept", fmtPct(spec.acceptance_rate) + len);
  }
}

function renderBar(barId, legendId, parts, total) {
  const bar = $(barId);
  const legend = $(legendId);
  bar.replaceChildren();
  legend.replaceChildren();
  for (const [cls, label, value] of parts) {
    const seg = document.createElement("div");
    seg.className = cls;
    seg.style.width = total > 0 ? `${(100 * value) / total}%` : "0%";
    seg.title = `${label}: ${fmtInt(value)}`;
    bar.appendChild(seg);
    const item = document.createElement("li");
    const swatch = document.createElement("i");
    swatch.className = cls;
    item.append(swatch, `${label} ${fmtInt(value)}`);
    legend.appendChild(item);
  }
}

function renderKv(kv) {
  setText("kv-total", `${fmtInt(kv.capacity)} pages of ${kv.page_size} tokens`);
  const parts = [
    ["held", "held by requests", kv.held],
    ["tree_locked", "tree, in use", kv.tree_locked],
    ["tree_pinned", "tree, pinned", kv.tree_pinned],
    ["tree_evictable", "tree, evictable", kv.tree_evictable],
    ["free", "free", kv.free],
  ];
  renderBar("kv-bar", "kv-legend", parts, kv.capacity);
}

function renderPrefill(c) {
  setText("prompt-tokens", fmtInt(c.prompt_tokens));
  setText("cached-tokens", fmtInt(c.cached_tokens));
  setText("prefill-computed", fmtInt(c.prefill_tokens_computed));
  const parts = [
    ["cached", "served from cache", c.cached_tokens],
    ["computed", "computed", c.prefill_tokens_computed],
  ];
  renderBar("prefill-bar", "prefill-legend", parts, c.cached_tokens + c.prefill_tokens_computed);
}

function renderLatency(lat) {
  const rows = [["TTFT", lat.ttft], ["ITL", lat.itl], ["E2E", lat.e2e]].map(([name, w]) => {
    const tr = document.createElement("tr");
    for (const text of [name, fmtSeconds(w.p50), fmtSeconds(w.p99), fmtInt(w.count)]) {
      const td = document.createElement("td");
      td.textContent = text;
      tr.appendChild(td);
    }
    return tr;
  });
  document.querySelector("#latency tbody").replaceChildren(...rows);
}

// ---- charts ------------------------------------------------------------------------

function push(series, value) {
  series.push(value === null || value === undefined ? null : value);
  if (series.length > HISTORY) series.shift();
}

function drawChart(canvasId, seriesList, colors, fixedMax) {
  const canvas = $(canvasId);
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  ctx.clearRect(0, 0, width, height);
  const values = seriesList.flat().filter((v) => v !== null);
  const max = fixedMax || Math.max(1, ...values);
  ctx.fillStyle = "#667085";
  ctx.font = "10px system-ui, sans-serif";
  ctx.fillText(fixedMax ? fmtPct(max) : fmtRate(max), 2, 10);
  seriesList.forEach((series, i) => {
    ctx.strokeStyle = colors[i];
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let pen = false;
    series.forEach((v, x) => {
      if (v === null) return void (pen = false);
      const px = width - ((series.length - 1 - x) / (HISTORY - 1)) * width; // newest at the right
      const py = height - 2 - (v / max) * (height - 14);
      pen ? ctx.lineTo(px, py) : ctx.moveTo(px, py);
      pen = true;
    });
    ctx.stroke();
  });
}

function renderCharts(s) {
  push(history.tokIn, s.throughput && s.throughput.input_tokens_per_s);
  push(history.tokOut, s.throughput && s.throughput.output_tokens_per_s);
  push(history.hit, s.cache.hit_rate_last_minute);
  push(history.running, s.requests.running);
  push(history.waiting, s.requests.waiting);
  const colors = ["#2e6f9e", "#e0894a"];
  drawChart("chart-tokens", [history.tokIn, history.tokOut], colors);
  drawChart("chart-hit", [history.hit], ["#3c9d6a"], 1);
  drawChart("chart-reqs", [history.running, history.waiting], colors);
}

// ---- radix tree icicle -------------------------------------------------------------

const ROW_PX = 30;

function hitLightness(hits, maxHits) {
  const t = maxHits > 0 ? Math.log1p(hits) / Math.log1p(maxHits) : 0;
  return 92 - 55 * t; // hits darken the node
}

function maxHitsOf(node) {
  return node.children.reduce((m, c) => Math.max(m, maxHitsOf(c)), node.hits);
}

function depthOf(node) {
  return 1 + node.children.reduce((m, c) => Math.max(m, depthOf(c)), 0);
}

function svgEl(name, attrs, parent) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  parent.appendChild(el);
  return el;
}

function drawNode(svg, node, x, y, w, maxHits) {
  const g = svgEl("g", { class: "node" }, svg);
  const light = hitLightness(node.hits, maxHits);
  const fill = `hsl(205, 60%, ${light}%)`;
  svgEl("rect", { x, y, width: Math.max(w, 0.5), height: ROW_PX, fill }, g);
  const title = svgEl("title", {}, g);
  title.textContent =
    `${JSON.stringify(node.label)}\n${fmtInt(node.tokens)} tokens in this node, ` +
    `${fmtInt(node.subtree_tokens)} in its subtree\n${fmtInt(node.hits)} hits` +
    (node.locked ? "\nin use by a running request" : "");
  if (w > 40) {
    const text = svgEl("text", { x: x + 4, y: y + 19, fill: light < 60 ? "#fff" : "#1d2330" }, g);
    const room = Math.floor((w - 8) / 6.5);
    const words = node.label.replace(/\s+/g, " ").trim() || "·";
    const label = y > 0 ? "…" + words : words; // below the top row: a continuation
    text.textContent = label.length > room ? label.slice(0, Math.max(room - 1, 1)) + "…" : label;
  }
  drawChildren(svg, node, x, y + ROW_PX, w, maxHits);
}

function drawChildren(svg, node, x, y, w, maxHits) {
  const total = node.subtree_tokens - node.tokens;
  if (total <= 0) return;
  for (const child of node.children) {
    const cw = (w * child.subtree_tokens) / total;
    drawNode(svg, child, x, y, cw, maxHits);
    x += cw;
  }
  if (node.num_hidden > 0) {
    const hw = (w * node.hidden_tokens) / total;
    const g = svgEl("g", {}, svg);
    svgEl("rect", { x, y, width: Math.max(hw, 0.5), height: ROW_PX, class: "hidden-children" }, g);
    svgEl("title", {}, g).textContent =
      `${node.num_hidden} smaller subtrees, ${fmtInt(node.hidden_tokens)} tokens`;
  }
}

function renderTree(tree) {
  const svg = $("tree");
  svg.replaceChildren();
  const empty = !tree || tree.children.length === 0;
  $("tree-empty").hidden = !empty;
  if (empty) return;
  const width = svg.clientWidth || 800;
  const height = (depthOf(tree) - 1) * ROW_PX;
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.style.height = `${height}px`;
  drawChildren(svg, tree, 0, 0, width, maxHitsOf(tree));
}

// ---- polling -----------------------------------------------------------------------

function render(s) {
  setText("model", s.model || "");
  renderTiles(s);
  renderKv(s.kv_pages);
  renderPrefill(s.cache);
  renderLatency(s.latency);
  renderCharts(s);
  renderTree(s.tree);
}

function setStatus(text, isError) {
  const el = $("status");
  el.textContent = text;
  el.classList.toggle("error", isError);
}

async function poll() {
  try {
    const resp = await fetch("/dashboard/stats", { cache: "no-store", credentials: "same-origin" });
    if (resp.status === 401) {
      setStatus("not logged in (the server restarted?): reload the page", true);
      return;
    }
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    render(await resp.json());
    setStatus(`updated ${new Date().toLocaleTimeString()}`, false);
  } catch (err) {
    setStatus(`server unreachable: ${err.message}`, true);
  }
  setTimeout(poll, POLL_MS);
}

document.addEventListener("DOMContentLoaded", poll);
