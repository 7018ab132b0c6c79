// The p2pdiloco dashboard page: polls /api/swarm (docs/dashboard.md) and redraws.
//
// Every value shown comes from peers' DHT records, i.e. from strangers. The DOM is built with
// createElement / setAttribute / textContent only: never innerHTML, never a string parsed as markup.
// The charts are hand-written SVG (no library, nothing fetched from elsewhere).
"use strict";

(function () {
  const SVG_NS = "http://www.w3.org/2000/svg";
  const PALETTE = ["#3b5bdb", "#e8590c", "#2b8a3e", "#c2255c", "#7048e8", "#0c8599", "#e67700", "#5c940d",
                   "#a61e4d", "#1864ab"];
  let lastDoc = null;
  let period = 2000;

  // ---- small DOM helpers (text only) ----------------------------------------------------------------
  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      // styles through the CSSOM: the page's Content-Security-Policy refuses inline style attributes
      if (k === "style") Object.assign(e.style, v);
      else e.setAttribute(k, String(v));
    }
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function svg(tag, attrs, text) {
    const e = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "style") Object.assign(e.style, v);
      else e.setAttribute(k, String(v));
    }
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  const $ = (id) => document.getElementById(id);
  const isNum = (v) => typeof v === "number" && isFinite(v);
  const short = (pid) => String(pid).slice(-6);

  function fmtBytes(n) {
    if (!isNum(n)) return "–";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
    return i === 0 ? n.toFixed(0) + " B" : n.toFixed(1) + " " + units[i];
  }
  function fmtRate(n) { return isNum(n) ? fmtBytes(n) + "/s" : "–"; }
  function fmtCount(n) {
    if (!isNum(n)) return "–";
    if (Math.abs(n) >= 1e6) return (n / 1e6).toFixed(2) + "M";
    if (Math.abs(n) >= 1e3) return (n / 1e3).toFixed(1) + "k";
    return String(Math.round(n));
  }
  // a magnitude from a million on in 3 significant figures (a stranger's 1e308 stays short)
  function fmtNum(n, digits) { return !isNum(n) ? "–" : Math.abs(n) < 1e6 ? n.toFixed(digits) : n.toPrecision(3); }
  // a peer's share of the last round's samples (issue 23: peers of different speeds)
  function fmtShare(n) { return isNum(n) && n >= 0 && n <= 1 ? (100 * n).toFixed(0) + "%" : "–"; }
  function fmtAgo(seconds) {
    if (!isNum(seconds)) return "never";
    if (seconds < 0) seconds = 0;
    if (seconds < 90) return seconds.toFixed(0) + " s ago";
    if (seconds < 5400) return (seconds / 60).toFixed(0) + " min ago";
    if (seconds < 172800) return (seconds / 3600).toFixed(1) + " h ago";
    return seconds < 864e6 ? (seconds / 86400).toFixed(0) + " d ago" : "long ago";
  }
  function fmtClock(t) {
    const d = new Date(t * 1000);
    if (!isNum(d.getTime())) return "–";
    return [d.getHours(), d.getMinutes(), d.getSeconds()].map((x) => String(x).padStart(2, "0")).join(":");
  }

  // ---- charts -----------------------------------------------------------------------------------------
  // Values come from strangers' records: any finite double may reach here (a loss range of one ulp,
  // steps near 2**62, 1e308). Every loop below is bounded by a count, never by a value reaching another.
  const MAX_TICKS = 64;
  function niceStep(span, count) {
    const raw = span / Math.max(1, count);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const f = raw / mag;
    return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * mag;
  }
  // round-number ticks in [lo, hi]; just the two ends when no round step is wider than the values'
  // rounding (a span of a few ulps: lo + step === lo) or the span is not finite
  function ticks(lo, hi, count) {
    if (!isNum(lo) || !isNum(hi)) return [];
    if (!(hi > lo)) return [lo];
    const step = niceStep(hi - lo, count);
    if (!isNum(step) || !(step > Math.max(Math.abs(lo), Math.abs(hi)) * 1e-12)) return [lo, hi];
    const first = Math.ceil(lo / step), n = Math.floor(hi / step + 1e-9) - first;
    if (!(n >= 0 && n < MAX_TICKS)) return [lo, hi];
    const out = [];
    for (let i = 0; i <= n; i++) out.push(+((first + i) * step).toPrecision(12));
    return out;
  }
  const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400];
  function timeTicks(lo, hi, count) {
    if (!isNum(lo) || !isNum(hi) || !(hi >= lo)) return [];
    const step = TIME_STEPS.find((s) => (hi - lo) / s <= count);
    if (step === undefined) return [lo, hi];
    const first = Math.ceil(lo / step), n = Math.min(Math.floor(hi / step) - first, MAX_TICKS - 1);
    const out = [];
    for (let i = 0; i <= n; i++) out.push((first + i) * step);
    return out;
  }
  // [lo, hi] of coordinate k of every point (loops: a spread of 200k arguments overflows the stack)
  function extent(series, k) {
    let lo = Infinity, hi = -Infinity;
    for (const s of series) {
      for (const p of s.points) {
        if (p[k] < lo) lo = p[k];
        if (p[k] > hi) hi = p[k];
      }
    }
    return [lo, hi];
  }
  // a range narrower than a billionth of its magnitude (or than 1e-300: subnormal steps) shows
  // rounding, not data: widened like an empty one
  function flat(lo, hi) { return !(hi - lo > Math.max(Math.abs(lo), Math.abs(hi), 1e-300) * 1e-9); }
  // where to scale: x0..x1 and y0..y1 (finite, x1 > x0, y1 > y0), and the ticks of both axes
  function axes(series, opts, xCount) {
    let [x0, x1] = extent(series, 0), [y0, y1] = extent(series, 1);
    if (opts.zeroY) y0 = Math.min(0, y0);
    const MAX = Number.MAX_VALUE;
    if (opts.xTime ? x1 === x0 : flat(x0, x1)) {
      const d = opts.xTime ? 30 : Math.max(1, Math.abs(x0) * 0.1);
      x0 = Math.max(x0 - d, -MAX); x1 = opts.xTime ? x1 : Math.min(x1 + d, MAX);
    }
    if (flat(y0, y1)) {
      const d = Math.abs(y0) * 0.1 || 1;
      y0 = opts.zeroY && y0 >= 0 ? 0 : Math.max(y0 - d, -MAX); y1 = Math.min(y1 + d, MAX);
    }
    let ys = ticks(y0, y1, 4);
    const step = ys.length > 1 ? ys[1] - ys[0] : 0;
    const lo = Math.floor(y0 / step) * step, hi = Math.ceil(y1 / step) * step;
    if (isNum(lo) && isNum(hi) && step > 0) { y0 = Math.min(y0, lo); y1 = Math.max(y1, hi); ys = ticks(y0, y1, 4); }
    const xs = opts.xTime ? timeTicks(x0, x1, xCount) : ticks(x0, x1, xCount);
    return {x0, x1, y0, y1, xs: opts.integerX ? xs.filter((v) => Number.isInteger(v)) : xs, ys};
  }
  // the position of v in [a, b] as a fraction (halves first: b - a of two doubles can overflow)
  const frac = (v, a, b) => (v / 2 - a / 2) / (b / 2 - a / 2);
  // circles (one element each, with a tooltip) on at most this many points; beyond, lines only
  const MAX_MARKERS = 2000;

  // series: [{label, color, points: [[x, y], ...]}]; opts: {xTime, integerX, yFmt, markers, zeroY, xLabel}
  function lineChart(box, series, opts) {
    const w = Math.max(240, box.clientWidth || 400);
    const h = Number(box.dataset.height) || 170;
    const m = {l: 58, r: 14, t: 8, b: opts.xLabel ? 36 : 22};
    const root = svg("svg", {viewBox: `0 0 ${w} ${h}`, width: "100%", height: h, role: "img"});
    const total = series.reduce((a, s) => a + s.points.length, 0);
    box.dataset.points = String(total);
    box.dataset.series = String(series.filter((s) => s.points.length).length);
    if (!total) {
      root.appendChild(svg("text", {x: w / 2, y: h / 2, "text-anchor": "middle", class: "nodata"},
                           opts.empty || "waiting for data"));
      box.replaceChildren(root);
      return;
    }
    const xCount = Math.max(2, Math.floor((w - m.l) / (opts.xTime ? 90 : 70)));
    const {x0, x1, y0, y1, xs, ys} = axes(series, opts, xCount);
    const X = (x) => m.l + frac(x, x0, x1) * (w - m.l - m.r);
    const Y = (y) => h - m.b - frac(y, y0, y1) * (h - m.t - m.b);

    const axis = svg("g", {class: "axis"});
    for (const v of ys) {
      axis.appendChild(svg("line", {x1: m.l, x2: w - m.r, y1: Y(v), y2: Y(v), class: "gridline"}));
      axis.appendChild(svg("text", {x: m.l - 8, y: Y(v) + 4, "text-anchor": "end"}, (opts.yFmt || String)(v)));
    }
    axis.appendChild(svg("line", {x1: m.l, x2: w - m.r, y1: h - m.b, y2: h - m.b, class: "baseline"}));
    for (const v of xs) {
      if (opts.xTime && X(v) - m.l < 20) continue;  // a clock label there would run into the y axis' labels
      axis.appendChild(svg("text", {x: X(v), y: h - m.b + 15, "text-anchor": "middle"},
                           opts.xTime ? fmtClock(v) : Math.abs(v) < 1e7 ? String(v) : v.toExponential(2)));
    }
    if (opts.xLabel) {
      axis.appendChild(svg("text", {x: m.l + (w - m.l - m.r) / 2, y: h - 3, "text-anchor": "middle", class: "label"},
                           opts.xLabel));
    }
    root.appendChild(axis);

    const drawn = series.filter((s) => s.points.length);
    drawn.forEach((s, k) => {
      // peers that agree draw the same line: each earlier one is a little wider (its points a ring
      // around the later ones'), so all stay visible
      const under = Math.min(drawn.length - 1 - k, 3);
      const g = svg("g", {class: "line"});
      const d = s.points.map((p, i) => (i ? "L" : "M") + X(p[0]).toFixed(1) + " " + Y(p[1]).toFixed(1)).join(" ");
      if (s.area) {
        const base = Y(Math.max(y0, 0)).toFixed(1);
        g.appendChild(svg("path", {d: `${d} L${X(s.points[s.points.length - 1][0]).toFixed(1)} ${base} ` +
                                      `L${X(s.points[0][0]).toFixed(1)} ${base} Z`, class: "area", fill: s.color}));
      }
      g.appendChild(svg("path", {d: d, class: "series" + (s.dashed ? " dashed" : ""), stroke: s.color,
                                 style: {strokeWidth: String(2 + 1.5 * under)}}));
      if (opts.markers && total <= MAX_MARKERS) {
        for (const p of s.points) {
          const c = svg("circle", {cx: X(p[0]), cy: Y(p[1]), r: 3.5 + 2 * under, class: under ? "pt ring" : "pt",
                                   stroke: s.color, fill: under ? "none" : s.color});
          c.appendChild(svg("title", {}, `${s.label}: outer step ${p[0]}, ${(opts.yFmt || String)(p[1])}`));
          g.appendChild(c);
        }
      }
      root.appendChild(g);
    });
    const legend = el("div", {class: "legend"});
    for (const s of series) {
      const item = el("span");
      item.appendChild(el("span", {class: "swatch", style: {background: s.color}}));
      item.appendChild(el("span", {class: s.mono ? "mono" : ""}, s.label));
      legend.appendChild(item);
    }
    box.replaceChildren(root);
    if (series.length > 1 || opts.legend) box.appendChild(legend);
  }

  // ---- sections ------------------------------------------------------------------------------------
  function colorMap(doc) {
    const ids = Array.from(new Set([...Object.keys(doc.val_loss || {}), ...Object.keys(doc.peers || {})])).sort();
    const map = {};
    ids.forEach((pid, i) => { map[pid] = PALETTE[i % PALETTE.length]; });
    return map;
  }

  function renderHeader(doc) {
    $("run-id").textContent = doc.run_id;
    document.title = `p2pdiloco · ${doc.run_id}`;
    const pill = $("conn");
    if (doc.dht && doc.dht.ok) {
      pill.className = "pill ok";
      pill.textContent = `live · read ${fmtClock(doc.dht.last_read)}`;
    } else {
      pill.className = doc.dht && doc.dht.reads ? "pill bad" : "pill wait";
      pill.textContent = (doc.dht && doc.dht.error) || "connecting…";
    }
  }

  function renderTiles(doc, peers) {
    $("t-peers").textContent = String(isNum(doc.peers_total) ? doc.peers_total : peers.length);
    const outer = peers.map(([, v]) => v.round).filter(isNum);
    $("t-outer").textContent = outer.length ? String(outer.reduce((a, b) => Math.max(a, b))) : "–";
    const last = (doc.rates || []).slice(-1)[0];
    const tokens = doc.seq_len ? last && last.tokens_per_s : last && last.samples_per_s;
    $("t-tokens-label").textContent = doc.seq_len ? "tokens/s" : "samples/s";
    $("t-tokens").textContent = last ? fmtCount(tokens) : "–";
    $("t-bytes").textContent = last ? fmtRate(last.sent_per_s) : "–";
    const dg = doc.digests || {};
    const tile = $("t-digest");
    if (!dg.groups || !dg.groups.length) {
      tile.textContent = "–";
      tile.className = "value";
    } else {
      const top = dg.groups[0].peers.length;
      const total = dg.groups.reduce((a, g) => a + g.peers.length, 0);
      tile.textContent = `${top} / ${total} agree`;
      tile.className = dg.groups.length === 1 ? "value ok" : "value bad";
    }
  }

  function renderPeers(doc, peers, colors) {
    const body = $("peers").tBodies[0];
    const rows = [];
    for (const [pid, v] of peers) {
      const tr = el("tr", {"data-peer": pid});
      const idCell = el("td", {class: "mono", title: pid});
      idCell.appendChild(el("span", {class: "swatch", style: {background: colors[pid]}}));
      idCell.appendChild(document.createTextNode(short(pid)));
      tr.appendChild(idCell);
      const reach = typeof v.reach === "string" ? v.reach : "?";
      const rc = el("td");
      const badge = ["public", "private", "relayed"].includes(reach) ? reach : "";
      // a relayed peer: the bytes it sent through its relay (its record's rb)
      rc.appendChild(el("span", {class: "badge " + badge}, reach === "relayed" && isNum(v.rb) ? "relayed " + fmtBytes(v.rb) : reach));
      tr.appendChild(rc);
      const lastSync = isNum(v.last_sync) ? fmtAgo(doc.time - v.last_sync) : "never";
      const workers = doc.local_workers && isNum(doc.local_workers[pid]) ? doc.local_workers[pid] : 1;
      for (const [text, cls] of [[workers, "num"], [isNum(v.round) ? v.round : "–", "num"], [isNum(v.step) ? v.step : "–", "num"],
                                 [fmtNum(v.rate, 1), "num"], [fmtShare(v.share), "num"], [fmtCount(v.samples), "num"],
                                 [fmtBytes(v.sent), "num"], [fmtBytes(v.recv), "num"], [lastSync, "num"],
                                 [fmtNum(v.loss, 3), "num"], [fmtNum(v.val_loss, 3), "num"]]) {
        tr.appendChild(el("td", {class: cls}, text));
      }
      rows.push(tr);
    }
    body.replaceChildren(...rows);
    $("peers-empty").classList.toggle("hidden", rows.length > 0);
  }

  function renderCharts(doc, colors) {
    const loss = Object.entries(doc.val_loss || {}).sort((a, b) => (a[0] < b[0] ? -1 : 1)).map(([pid, pts]) => ({
      label: short(pid) + (doc.peers && doc.peers[pid] ? "" : " (left)"), color: colors[pid], mono: true,
      points: pts.filter((p) => isNum(p[0]) && isNum(p[1])),
    }));
    lineChart($("loss-chart"), loss, {markers: true, integerX: true, yFmt: (v) => fmtNum(v, 2),
                                      xLabel: "outer step", legend: true, empty: "no validation loss yet"});
    const rates = (doc.rates || []).filter((r) => isNum(r.t));
    const tokensKey = doc.seq_len ? "tokens_per_s" : "samples_per_s";
    $("tokens-title").textContent = doc.seq_len ? "Swarm tokens/s" : "Swarm samples/s";
    lineChart($("tokens-chart"), [{label: tokensKey.replace(/_per_s$/, "/s"), color: PALETTE[0],
                                   area: true,
                                   points: rates.filter((r) => isNum(r[tokensKey])).map((r) => [r.t, r[tokensKey]])}],
              {xTime: true, zeroY: true, yFmt: fmtCount});
    lineChart($("bytes-chart"), [
      {label: "sent", color: PALETTE[1], area: true,
       points: rates.filter((r) => isNum(r.sent_per_s)).map((r) => [r.t, r.sent_per_s])},
      {label: "received", color: PALETTE[5], dashed: true,
       points: rates.filter((r) => isNum(r.recv_per_s)).map((r) => [r.t, r.recv_per_s])},
    ], {xTime: true, zeroY: true, yFmt: fmtBytes});
  }

  function renderDigests(doc, colors) {
    const box = $("digests");
    const dg = doc.digests || {};
    const out = [];
    if (!dg.groups || !dg.groups.length) {
      out.push(el("p", {class: "empty"}, "No peer has published a synced state yet."));
    } else {
      const total = dg.groups.reduce((a, g) => a + g.peers.length, 0);
      const ok = dg.groups.length === 1;
      out.push(el("div", {class: "digest-summary " + (ok ? "ok" : "bad")},
                  ok ? (total === 1 ? `1 peer at the last sync (inner step ${dg.step})`
                                    : `All ${total} peers agree at the last sync (inner step ${dg.step})`)
                     : `${dg.groups.length} different states at inner step ${dg.step}: peers disagree`));
      for (const g of dg.groups) {
        const row = el("div", {class: "digest-row"});
        row.appendChild(el("span", {class: "mono", title: g.digest}, String(g.digest).slice(0, 16)));
        const bar = el("div", {class: "bar"});
        bar.appendChild(el("div", {style: {width: `${(100 * g.peers.length / total).toFixed(1)}%`}}));
        row.appendChild(bar);
        row.appendChild(el("span", {}, `${g.peers.length} peer${g.peers.length === 1 ? "" : "s"}`));
        out.push(row);
        out.push(el("div", {class: "digest-peers mono"}, g.peers.map(short).join("  ")));
      }
      if (dg.elsewhere && dg.elsewhere.length) {
        out.push(el("p", {class: "empty"},
                    `${dg.elsewhere.length} other peer(s) not at that step: ${dg.elsewhere.map(short).join(", ")}`));
      }
    }
    box.replaceChildren(...out);
  }

  function renderFailures(doc, colors) {
    const rows = (doc.failures || []).slice(0, 12).map((f) => {
      const tr = el("tr");
      tr.appendChild(el("td", {class: "mono"}, isNum(f.t) ? fmtClock(f.t) : "–"));
      const who = el("td", {class: "mono", title: f.peer});
      who.appendChild(el("span", {class: "swatch", style: {background: colors[f.peer] || "#adb5bd"}}));
      who.appendChild(document.createTextNode(short(f.peer)));
      tr.appendChild(who);
      tr.appendChild(el("td", {class: "num"}, isNum(f.outer_step) ? f.outer_step : "–"));
      tr.appendChild(el("td", {class: "num"}, isNum(f.fragment) ? f.fragment : "–"));
      tr.appendChild(el("td", {class: "reason"}, f.reason));
      return tr;
    });
    $("failures").tBodies[0].replaceChildren(...rows);
    $("failures-empty").classList.toggle("hidden", rows.length > 0);
  }

  function render(doc) {
    lastDoc = doc;
    const peers = Object.entries(doc.peers || {}).sort((a, b) => (a[0] < b[0] ? -1 : 1));
    const colors = colorMap(doc);
    renderHeader(doc);
    renderTiles(doc, peers);
    renderPeers(doc, peers, colors);
    renderCharts(doc, colors);
    renderDigests(doc, colors);
    renderFailures(doc, colors);
    document.body.dataset.updated = String(doc.time);
  }

  async function poll() {
    try {
      const r = await fetch("/api/swarm", {cache: "no-store"});
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      const doc = await r.json();
      if (isNum(doc.period) && doc.period > 0) period = Math.max(1000, doc.period * 1000);
      render(doc);
    } catch (e) {
      const pill = $("conn");
      pill.className = "pill bad";
      pill.textContent = "dashboard server unreachable";
    }
    setTimeout(poll, period);
  }

  if (typeof module === "object" && module.exports) {
    module.exports = {ticks, timeTicks, niceStep, axes};  // tests/test_dashboard.py runs these under node
  }
  if (typeof window === "object") {
    window.addEventListener("resize", () => { if (lastDoc) renderCharts(lastDoc, colorMap(lastDoc)); });
    poll();
  }
})();
