"""The attention explorer of report.html: every block's and head's attention and the explanation maps of a few
images, embedded compactly in the page, drawn by a little inline JavaScript (no server, no CDN, works offline).

Encoding: per image, each block's attention (heads, queries, keys) is stored row by row in 4 bits (two values a
byte; or 8 bits), each row divided by its maximum (row maxima kept as float32, so head means are exact up to
the rounding), the whole image zlib-compressed and base64-encoded; the page inflates it with the browser's
DecompressionStream.
Explanation maps are uint8 per patch. The figure PNGs are embedded as data: URLs.
"""
from __future__ import annotations

import base64
import io
import json
import zlib
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from ..errors import VitlabError
from .capture import AttentionMap


def png_data_url(image: np.ndarray, scale: int = 1) -> str:
    """An (H, W, C) image in [0, 1] as a PNG data: URL (nearest-neighbour upscaled by scale)."""
    a = (np.clip(image, 0, 1) * 255 + 0.5).astype(np.uint8)
    if a.shape[-1] == 1:
        a = a[..., 0]
    elif a.shape[-1] != 3:
        a = a.mean(axis=-1).astype(np.uint8)
    img = Image.fromarray(a)
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


BITS = (4, 8)


def encode_attention(maps: Sequence[AttentionMap], index: int, bits: int = 4) -> str:
    """One image's attention of every block: row-max-scaled rows in 4 or 8 bits (4: two per byte, high nibble
    first, padded to whole bytes per block) + float32 row maxima, zlib, base64."""
    if bits not in BITS:
        raise VitlabError(f"bits must be one of {BITS}, got {bits}")
    levels = 2 ** bits - 1
    parts = []
    for m in maps:
        a = m.attn[index].float().clamp(min=0).cpu().numpy()  # (heads, Q, K)
        top = a.max(axis=-1, keepdims=True)  # (heads, Q, 1)
        q = np.rint(a / np.maximum(top, 1e-30) * levels).astype(np.uint8).reshape(-1)
        if bits == 4:
            q = np.append(q, np.uint8(0)) if len(q) % 2 else q
            q = (q[0::2] << 4) | q[1::2]
        parts += [q.tobytes(), top.astype("<f4").tobytes()]
    return base64.b64encode(zlib.compress(b"".join(parts), 9)).decode("ascii")


def encode_map(values: torch.Tensor) -> str:
    """A (grid_h, grid_w) map in [0, 1] as base64 uint8."""
    v = np.rint(values.float().clamp(0, 1).cpu().numpy() * 255).astype(np.uint8)
    return base64.b64encode(v.tobytes()).decode("ascii")


def explorer_data(maps: Sequence[AttentionMap], display: np.ndarray, names: Sequence[str], captions: Sequence[str],
                  methods: dict[str, tuple[str, torch.Tensor]], scores: dict[str, list[dict]] | None = None,
                  summary: dict[str, dict] | None = None, max_images: int | None = None, bits: int = 4) -> dict:
    """The explorer's JSON: images, block layout, encoded attention and maps, per-image and set faithfulness.

    methods: key -> (label, maps (B, grid_h, grid_w) in [0, 1]); scores: key -> per image
    {'deletion_auc', 'insertion_auc'}; summary: key -> set-level AUCs.
    """
    B = len(display) if max_images is None else min(len(display), max_images)
    H, W = display.shape[1:3]
    scale = max(1, 256 // max(H, W))
    gh, gw = maps[-1].grid_size
    return {
        "grid": [gh, gw], "image_size": [H, W], "bits": bits,
        "images": [{"name": names[i], "caption": captions[i], "src": png_data_url(display[i], scale)}
                   for i in range(B)],
        "blocks": [{"name": m.name, "kind": m.kind, "heads": m.num_heads, "queries": m.attn.shape[2],
                    "keys": m.attn.shape[3], "prefix": list(m.prefix_tokens)} for m in maps],
        "attention": [encode_attention(maps, i, bits) for i in range(B)],
        "methods": [{"key": k, "label": label, "maps": [encode_map(v[i]) for i in range(B)],
                     "scores": (scores or {}).get(k, [None] * B)[:B], "summary": (summary or {}).get(k)}
                    for k, (label, v) in methods.items()],
    }


EXPLORER_CSS = """
#explorer .controls { display: flex; flex-wrap: wrap; gap: 0.6em 1.2em; align-items: center; margin: 0.5em 0; }
#explorer .views { display: flex; flex-wrap: wrap; gap: 1.5em; }
#explorer canvas { border: 1px solid #999; cursor: crosshair; image-rendering: pixelated; }
#explorer .info { font-size: 0.9em; color: #333; max-width: 22em; }
#explorer .bar { height: 10px; width: 256px; background: linear-gradient(to right, #000004, #420a68, #932667,
  #dd513a, #fca50a, #fcffa4); }
"""

EXPLORER_JS = r"""
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("explorer-data").textContent);
  const $ = (id) => document.getElementById(id);
  const [GH, GW] = D.grid, N = GH * GW, SIZE = 256;
  const LUT = [[0, 0, 4], [66, 10, 104], [147, 38, 103], [221, 81, 58], [252, 165, 10], [252, 255, 164]];
  const cache = {};
  const state = { image: 0, layer: D.blocks.length - 1, head: "mean", query: "cls", method: 0 };

  function colour(v) {
    const x = Math.min(Math.max(v, 0), 1) * (LUT.length - 1), i = Math.min(Math.floor(x), LUT.length - 2), f = x - i;
    return LUT[i].map((c, k) => Math.round(c + f * (LUT[i + 1][k] - c)));
  }
  function b64(s) {
    const bin = atob(s), out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }
  async function attention(image) {  // -> per block {q: Uint8Array, top: Float32Array}
    if (cache[image]) return cache[image];
    const stream = new Blob([b64(D.attention[image])]).stream().pipeThrough(new DecompressionStream("deflate"));
    const buf = await new Response(stream).arrayBuffer();
    let off = 0;
    const blocks = D.blocks.map((b) => {
      const n = b.heads * b.queries * b.keys, bytes = D.bits === 4 ? Math.ceil(n / 2) : n;
      const q = new Uint8Array(buf, off, bytes);
      off += bytes;
      const top = new Float32Array(buf.slice(off, off + 4 * b.heads * b.queries));
      off += 4 * b.heads * b.queries;
      return { q: q, top: top };
    });
    cache[image] = blocks;
    return blocks;
  }
  function level(q, i) {  // the i-th quantised value, 0 .. 1
    return D.bits === 4 ? ((i & 1) ? q[i >> 1] & 15 : q[i >> 1] >> 4) / 15 : q[i] / 255;
  }
  function row(blk, data, head, query) {  // attention of one query row over the patch keys (length N)
    const P = blk.keys - N, K = blk.keys, out = new Float32Array(N);
    const heads = head === "mean" ? [...Array(blk.heads).keys()] : [Number(head)];
    for (const h of heads) {
      const r = h * blk.queries + query, scale = data.top[r] / heads.length;
      for (let j = 0; j < N; j++) out[j] += level(data.q, r * K + P + j) * scale;
    }
    return out;
  }
  function queryRow(blk, data, head) {  // the chosen query; what it is, in words; its row (null: a mean)
    const P = blk.keys - N;
    if (blk.queries === 1) return [row(blk, data, head, 0), blk.kind === "attn_pool" ?
      "the pooling head's learned query (its only query)" : "the class token (the only query of class attention)", 0];
    if (state.query === "cls" || state.query === "dist") {
      const t = blk.prefix.indexOf(state.query);
      const name = state.query === "cls" ? "the class token" : "the distillation token";
      if (t >= 0) return [row(blk, data, head, t), name, t];
      const out = new Float32Array(N);  // no such token in this block: the mean over the patch queries
      for (let q = 0; q < N; q++) row(blk, data, head, P + q).forEach((v, j) => { out[j] += v / N; });
      return [out, "the mean of the patch queries (no " + state.query + " token in this block)", null];
    }
    const p = Number(state.query);
    return [row(blk, data, head, P + p), "patch (" + Math.floor(p / GW) + ", " + (p % GW) + ")", P + p];
  }
  function prefixShares(blk, data, head, query) {  // in words: the query's attention on each non-patch token
    const P = blk.keys - N, K = blk.keys;
    if (query === null || P === 0) return "";
    const heads = head === "mean" ? [...Array(blk.heads).keys()] : [Number(head)];
    const share = new Float32Array(P);
    for (const h of heads) {
      const r = h * blk.queries + query;
      for (let j = 0; j < P; j++) share[j] += level(data.q, r * K + j) * data.top[r] / heads.length;
    }
    let reg = 0;
    const names = blk.prefix.map((t) => (t === "reg" ? "register " + reg++ : t === "cls" ? "class token" :
      t === "dist" ? "distillation token" : t));
    return " Its attention on the tokens that are no patch: " +
      names.map((t, j) => t + " " + (100 * share[j]).toFixed(1) + "%").join(", ") + ".";
  }
  function draw(canvas, values, marker) {
    const ctx = canvas.getContext("2d"), img = $("x-img-" + state.image);
    ctx.imageSmoothingEnabled = false;
    ctx.clearRect(0, 0, SIZE, SIZE);
    ctx.drawImage(img, 0, 0, SIZE, SIZE);
    let top = 0;
    values.forEach((v) => { top = Math.max(top, v); });
    const cw = SIZE / GW, ch = SIZE / GH;
    let sum = 0;
    for (let p = 0; p < N; p++) {
      const v = top > 0 ? values[p] / top : 0, [r, g, b] = colour(v);
      sum += Math.round(v * 255);
      ctx.fillStyle = "rgba(" + r + "," + g + "," + b + ",0.6)";
      ctx.fillRect((p % GW) * cw, Math.floor(p / GW) * ch, cw, ch);
    }
    if (marker !== null) {
      ctx.strokeStyle = "#00e5ff";
      ctx.lineWidth = 2;
      ctx.strokeRect((marker % GW) * cw + 1, Math.floor(marker / GW) * ch + 1, cw - 2, ch - 2);
    }
    canvas.dataset.checksum = String(sum);
  }
  async function render() {
    const blk = D.blocks[state.layer], data = (await attention(state.image))[state.layer];
    const head = state.head === "mean" || Number(state.head) < blk.heads ? state.head : "mean";
    const [values, what, query] = queryRow(blk, data, head);
    const canvas = $("x-attention");
    draw(canvas, values, /^\d+$/.test(state.query) ? Number(state.query) : null);
    Object.assign(canvas.dataset, { image: state.image, layer: state.layer, head: head, query: state.query });
    $("x-attention-info").textContent = blk.name + " (" + blk.kind + "), " +
      (head === "mean" ? "mean of " + blk.heads + " heads" : "head " + head) + ": attention of " + what +
      " to the patches, scaled to its maximum." + prefixShares(blk, data, head, query) +
      " Click a patch to make it the query.";
    const m = D.methods[state.method];
    if (m) {
      const v = b64(m.maps[state.image]);
      draw($("x-method"), Array.from(v, (x) => x / 255), null);
      $("x-method").dataset.method = m.key;
      const s = m.scores[state.image], t = m.summary;
      let text = m.label + ".";
      if (s) text += " This image: deletion AUC " + s.deletion_auc.toFixed(3) + ", insertion AUC " +
        s.insertion_auc.toFixed(3) + ".";
      if (t) text += " Over the set: deletion " + t.deletion_auc.toFixed(3) + ", insertion " +
        t.insertion_auc.toFixed(3) + ", positive perturbation " + t.positive_auc.toFixed(1) + ", negative " +
        t.negative_auc.toFixed(1) + (t.road_morf_auc === undefined ? "" : ", ROAD MoRF " +
        t.road_morf_auc.toFixed(1) + ", LeRF " + t.road_lerf_auc.toFixed(1)) + ".";
      $("x-method-info").textContent = text;
    }
    $("x-caption").textContent = D.images[state.image].caption;
    document.body.dataset.ready = "1";
  }
  function fillHeads() {
    const blk = D.blocks[state.layer], sel = $("x-head"), keep = sel.value || "mean";
    sel.innerHTML = "";
    ["mean", ...Array(blk.heads).keys()].forEach(
      (h) => sel.add(new Option(h === "mean" ? "mean of heads" : "head " + h, String(h))));
    sel.value = [...sel.options].some((o) => o.value === keep) ? keep : "mean";
    state.head = sel.value;
  }
  function setup() {
    D.images.forEach((im, i) => {
      $("x-image").add(new Option(i + ": " + im.name, String(i)));
      const el = new Image();
      el.id = "x-img-" + i;
      el.src = im.src;
      el.hidden = true;
      document.body.appendChild(el);
    });
    D.blocks.forEach((b, i) => $("x-layer").add(new Option(b.name + " (" + b.kind + ")", String(i))));
    D.methods.forEach((m, i) => $("x-method-select").add(new Option(m.label, String(i))));
    const tokens = new Set(D.blocks.flatMap((b) => b.prefix));
    $("x-query-dist").hidden = !tokens.has("dist");
    $("x-layer").value = String(state.layer);
    fillHeads();
    $("x-image").onchange = (e) => { state.image = Number(e.target.value); render(); };
    $("x-layer").onchange = (e) => { state.layer = Number(e.target.value); fillHeads(); render(); };
    $("x-head").onchange = (e) => { state.head = e.target.value; render(); };
    $("x-method-select").onchange = (e) => { state.method = Number(e.target.value); render(); };
    $("x-query-cls").onclick = () => { state.query = "cls"; render(); };
    $("x-query-dist").onclick = () => { state.query = "dist"; render(); };
    $("x-attention").onclick = (e) => {
      const r = e.target.getBoundingClientRect();
      const c = Math.min(GW - 1, Math.floor((e.clientX - r.left) / r.width * GW));
      const rr = Math.min(GH - 1, Math.floor((e.clientY - r.top) / r.height * GH));
      state.query = String(rr * GW + c);
      render();
    };
    const first = $("x-img-0");
    if (first.complete) render(); else first.onload = render;
  }
  setup();
})();
"""


def explorer_html(data: dict) -> str:
    """The explorer's section for report.html: controls, two canvases, the embedded data and the script."""
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return f"""<section id="explorer"><h2>Attention explorer</h2>
<p>Pick an image, a block and a head (or their mean); click a patch of the left image to see where that patch
attends. The right image shows an explanation map with its faithfulness scores (deletion: lower is better;
insertion and negative perturbation: higher is better).</p>
<div class="controls">
<label>image <select id="x-image"></select></label>
<label>block <select id="x-layer"></select></label>
<label>head <select id="x-head"></select></label>
<button id="x-query-cls" type="button">query: class token</button>
<button id="x-query-dist" type="button">query: distillation token</button>
<label>explanation <select id="x-method-select"></select></label>
</div>
<p id="x-caption"></p>
<div class="views">
<div><canvas id="x-attention" width="256" height="256"></canvas><div class="bar"></div>
<p class="info" id="x-attention-info"></p></div>
<div><canvas id="x-method" width="256" height="256"></canvas><div class="bar"></div>
<p class="info" id="x-method-info"></p></div>
</div>
<script type="application/json" id="explorer-data">{payload}</script>
<script>{EXPLORER_JS}</script>
</section>"""
