// Small canvas charts for the dashboard: time series lines and a stacked area, with a hover read-out.
// Points are {t: unix seconds, ...}; the x axis is the last `span` seconds up to the newest point.
"use strict";

const LPChart = (() => {
  const GRID = "#232b37", AXIS_TEXT = "#8a96a8", FONT = "11px system-ui, sans-serif";
  const PAD = { left: 52, right: 12, top: 10, bottom: 22 };

  // A y axis of four round steps (so every gridline label is a round number), a little above the data.
  function niceMax(value, floor) {
    const v = Math.max(value || 0, floor || 0) * 1.05;
    if (v <= 0) return 1;
    const quarter = v / 4, exp = Math.pow(10, Math.floor(Math.log10(quarter)));
    for (const m of [1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10]) if (m * exp >= quarter) return 4 * m * exp;
    return 40 * exp;
  }

  function prepare(canvas) {
    const dpr = window.devicePixelRatio || 1;
    const width = canvas.clientWidth, height = canvas.clientHeight;
    if (canvas.width !== Math.round(width * dpr) || canvas.height !== Math.round(height * dpr)) {
      canvas.width = Math.round(width * dpr);
      canvas.height = Math.round(height * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    return { ctx, width, height, plotW: width - PAD.left - PAD.right, plotH: height - PAD.top - PAD.bottom };
  }

  function frame(g, t0, span, yMax, yFormat) {
    const { ctx, width, plotW, plotH } = g;
    ctx.font = FONT;
    ctx.lineWidth = 1;
    ctx.fillStyle = AXIS_TEXT;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let i = 0; i <= 4; i++) {
      const y = PAD.top + plotH - (plotH * i) / 4;
      ctx.strokeStyle = GRID;
      ctx.beginPath(); ctx.moveTo(PAD.left, Math.round(y) + 0.5); ctx.lineTo(width - PAD.right, Math.round(y) + 0.5); ctx.stroke();
      ctx.fillText(i === 0 ? "0" : yFormat((yMax * i) / 4), PAD.left - 6, y);
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const step = span > 180 ? 60 : span > 60 ? 30 : 10;
    for (let ago = 0; ago <= span; ago += step) {
      const x = PAD.left + plotW * (1 - ago / span);
      ctx.fillText(ago === 0 ? "now" : ago % 60 === 0 ? "-" + ago / 60 + "m" : "-" + ago + "s", x, PAD.top + plotH + 6);
    }
  }

  function xOf(g, t, t0, span) { return PAD.left + g.plotW * ((t - t0) / span); }
  function yOf(g, v, yMax) { return PAD.top + g.plotH * (1 - Math.min(v, yMax) / yMax); }

  // Hover: a vertical rule at the nearest point and its values, redrawn on every mouse move.
  function attachHover(canvas, state) {
    if (canvas.dataset.hover) return;
    canvas.dataset.hover = "1";
    canvas.addEventListener("mousemove", (e) => { state.hoverX = e.offsetX; state.redraw(); });
    canvas.addEventListener("mouseleave", () => { state.hoverX = null; state.redraw(); });
  }

  function drawHover(g, state, points, t0, span, rows) {
    if (state.hoverX === null || state.hoverX === undefined || !points.length) return;
    let best = null, bestDx = Infinity;
    for (const p of points) {
      const dx = Math.abs(xOf(g, p.t, t0, span) - state.hoverX);
      if (dx < bestDx) { bestDx = dx; best = p; }
    }
    if (!best || bestDx > 30) return;
    const { ctx } = g;
    const x = xOf(g, best.t, t0, span);
    ctx.strokeStyle = "#5b6676";
    ctx.beginPath(); ctx.moveTo(x + 0.5, PAD.top); ctx.lineTo(x + 0.5, PAD.top + g.plotH); ctx.stroke();
    const lines = [new Date(best.t * 1000).toLocaleTimeString(), ...rows(best)];
    ctx.font = FONT;
    const w = Math.max(...lines.map((l) => ctx.measureText(l.text || l).width)) + 20;
    const h = lines.length * 15 + 8;
    const bx = x + w + 12 > g.width ? x - w - 8 : x + 8;
    ctx.fillStyle = "rgba(13,17,23,.92)"; ctx.strokeStyle = "#283040";
    ctx.fillRect(bx, PAD.top + 4, w, h); ctx.strokeRect(bx + 0.5, PAD.top + 4.5, w, h);
    ctx.textAlign = "left"; ctx.textBaseline = "top";
    lines.forEach((line, i) => {
      const y = PAD.top + 9 + i * 15;
      if (typeof line === "string") { ctx.fillStyle = AXIS_TEXT; ctx.fillText(line, bx + 8, y); return; }
      ctx.fillStyle = line.color; ctx.fillRect(bx + 8, y + 2, 7, 7);
      ctx.fillStyle = "#dce3ec"; ctx.fillText(line.text, bx + 19, y);
    });
  }

  // What every chart does first: remember its data (hover redraws with it), clear the canvas and pick the
  // time window, the last `span` seconds up to the newest point. Null while the canvas has no size.
  function begin(canvas, points, opts, draw) {
    const state = canvas._lp || (canvas._lp = {});
    state.redraw = () => draw(canvas, state.points, state.opts);
    state.points = points; state.opts = opts;
    attachHover(canvas, state);
    const g = prepare(canvas);
    if (!g.plotW || !g.plotH) return null;
    const span = opts.span || 300;
    const t1 = points.length ? points[points.length - 1].t : Date.now() / 1000;
    return { g, state, span, t0: t1 - span };
  }

  // series: [{label, color, value: point => number|null}]
  function line(canvas, points, opts) {
    const view = begin(canvas, points, opts, line);
    if (!view) return;
    const { g, state, span, t0 } = view;
    const visible = points.filter((p) => p.t >= t0);
    let top = 0;
    for (const s of opts.series) for (const p of visible) { const v = s.value(p); if (v !== null && isFinite(v)) top = Math.max(top, v); }
    const yMax = niceMax(top, opts.floor);
    frame(g, t0, span, yMax, opts.yFormat);
    const { ctx } = g;
    opts.series.forEach((s, index) => {
      ctx.strokeStyle = s.color; ctx.lineWidth = 1.8; ctx.lineJoin = "round";
      let run = [];
      const flush = () => {
        if (!run.length) return;
        ctx.beginPath();
        run.forEach(([x, y], i) => (i ? ctx.lineTo(x, y) : ctx.moveTo(x, y)));
        ctx.stroke();
        if (index === 0 && run.length > 1) {  // a faint fill under the first series
          ctx.lineTo(run[run.length - 1][0], PAD.top + g.plotH); ctx.lineTo(run[0][0], PAD.top + g.plotH); ctx.closePath();
          ctx.globalAlpha = 0.12; ctx.fillStyle = s.color; ctx.fill(); ctx.globalAlpha = 1;
        }
        run = [];
      };
      for (const p of visible) {
        const v = s.value(p);
        if (v === null || v === undefined || !isFinite(v)) { flush(); continue; }
        run.push([xOf(g, p.t, t0, span), yOf(g, v, yMax)]);
      }
      flush();
    });
    drawHover(g, state, visible, t0, span, (p) => opts.series.map((s) => ({ color: s.color, text: s.label + ": " + opts.yFormat(s.value(p)) })));
  }

  // layers: [{label, color, value: point => number}] stacked bottom-up; max: point => number (the full height).
  function stacked(canvas, points, opts) {
    const view = begin(canvas, points, opts, stacked);
    if (!view) return;
    const { g, state, span, t0 } = view;
    const visible = points.filter((p) => p.t >= t0 && opts.max(p) > 0);
    const yMax = visible.length ? Math.max(...visible.map(opts.max)) : 1;
    frame(g, t0, span, yMax, opts.yFormat);
    const { ctx } = g;
    const base = visible.map(() => 0);
    for (const layer of opts.layers) {
      if (visible.length < 2) break;
      const top = visible.map((p, i) => base[i] + (layer.value(p) || 0));
      ctx.beginPath();
      visible.forEach((p, i) => { const x = xOf(g, p.t, t0, span), y = yOf(g, top[i], yMax); i ? ctx.lineTo(x, y) : ctx.moveTo(x, y); });
      for (let i = visible.length - 1; i >= 0; i--) ctx.lineTo(xOf(g, visible[i].t, t0, span), yOf(g, base[i], yMax));
      ctx.closePath();
      ctx.fillStyle = layer.color; ctx.globalAlpha = layer.alpha || 0.85; ctx.fill(); ctx.globalAlpha = 1;
      top.forEach((v, i) => (base[i] = v));
    }
    drawHover(g, state, visible, t0, span, (p) => opts.layers.map((l) => ({ color: l.color, text: l.label + ": " + opts.yFormat(l.value(p)) })));
  }

  return { line, stacked };
})();
