// The live dashboard: polls /v1/status once a second and draws what it says.
"use strict";

(() => {
  const POLL_MS = 1000;
  const SPAN_S = 300;
  const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  const C = {};
  let points = [];
  let timer = null;

  function merge(series) {
    const last = points.length ? points[points.length - 1].t : 0;
    for (const p of series) if (p.t > last) points.push(p);
    const cutoff = (points.length ? points[points.length - 1].t : 0) - SPAN_S - 5;
    while (points.length && points[0].t < cutoff) points.shift();
  }

  async function poll() {
    clearTimeout(timer);
    try {
      const status = await LP.api("/v1/status?history=" + (points.length ? 5 : SPAN_S));
      LP.banner("", "");
      merge(status.series);
      render(status);
    } catch (error) {
      if (LP.keyProblem(error)) {
        LP.banner("error", "The status needs the admin key (" + error.message + ").");
        setReady("bad", "admin key needed");
        return;  // polling resumes when a key is entered
      }
      LP.banner("error", "Cannot read /v1/status: " + error.message);
      setReady("bad", "unreachable");
    }
    timer = setTimeout(poll, POLL_MS);
  }

  function setReady(kind, text) {
    document.getElementById("ready-dot").className = "dot " + kind;
    document.getElementById("ready-text").textContent = text;
  }

  function render(s) {
    LP.setText("model-name", s.model.name);
    LP.setText("uptime", LP.fmt.duration(s.uptime_s));
    const failing = Object.entries(s.checks).filter(([, ok]) => !ok).map(([name]) => name);
    setReady(s.ready ? "ok" : "bad", s.ready ? "ready" : "not ready: " + failing.join(", "));

    const t = s.throughput, lat = s.latency;
    LP.setText("tile-rps", LP.fmt.num(t.requests_per_s, 2), t.requests_per_s);
    LP.setText("tile-tps", LP.fmt.num(t.tokens_per_s, 1), t.tokens_per_s);
    LP.setText("tile-ttft", LP.fmt.ms(lat.ttft.p50_s), lat.ttft.p50_s);
    LP.setText("tile-ttft-sub", "p90 " + LP.fmt.ms(lat.ttft.p90_s) + " · p99 " + LP.fmt.ms(lat.ttft.p99_s));
    LP.setText("tile-tpot", LP.fmt.ms(lat.per_token.p50_s), lat.per_token.p50_s);
    LP.setText("tile-tpot-sub", "p90 " + LP.fmt.ms(lat.per_token.p90_s) + " · mean " + LP.fmt.ms(lat.per_token.mean_s));
    LP.setText("queue-depth", LP.fmt.int(s.scheduler.queue_depth), s.scheduler.queue_depth);
    LP.setText("in-flight", LP.fmt.int(s.requests.in_flight), s.requests.in_flight);
    const running = s.workers.reduce((n, w) => n + w.running, 0);
    LP.setText("running-sub", LP.fmt.int(running) + " running on workers");
    const healthy = s.workers.filter((w) => w.healthy).length;
    LP.setText("tile-workers", healthy + " / " + s.workers.length, healthy);

    renderCharts();
    renderWorkers(s.workers);
    renderTiers(s.adapters, s.adapter_store.arena);
    renderTotals(s);
  }

  function renderCharts() {
    const rate = (v) => LP.fmt.num(v, v < 10 ? 1 : 0);
    const ms = (v) => (v === null || v === undefined ? "–" : LP.fmt.ms(v));
    LPChart.line(document.getElementById("chart-requests"), points, {
      span: SPAN_S, yFormat: rate, floor: 1,
      series: [{ label: "requests/s", color: C.kv, value: (p) => p.requests_per_s }] });
    LPChart.line(document.getElementById("chart-tokens"), points, {
      span: SPAN_S, yFormat: rate, floor: 10,
      series: [{ label: "tokens/s", color: C.ok, value: (p) => p.tokens_per_s }] });
    LPChart.line(document.getElementById("chart-latency"), points, {
      span: SPAN_S, yFormat: ms, floor: 0.01,
      series: [{ label: "first token", color: C.host, value: (p) => p.ttft_s },
               { label: "per token", color: C.adapter, value: (p) => p.per_token_s }] });
    LPChart.line(document.getElementById("chart-queue"), points, {
      span: SPAN_S, yFormat: (v) => LP.fmt.num(v, 0), floor: 4,
      series: [{ label: "queue", color: C.bad, value: (p) => p.queue_depth },
               { label: "running", color: C.kv, value: (p) => p.running }] });

    const workers = points.length ? Object.keys(points[points.length - 1].pool) : [];
    const grid = document.getElementById("pool-charts");
    for (const id of workers) {
      if (grid.querySelector(`[data-worker="${CSS.escape(id)}"]`)) continue;
      grid.append(LP.el("div", { dataset: { worker: id } },
        LP.el("div", { class: "pool-title" }, id), LP.el("canvas", { class: "chart" })));
    }
    for (const box of [...grid.children]) {
      const id = box.dataset.worker;
      if (!workers.includes(id)) { box.remove(); continue; }
      const slot = (kind) => (p) => (p.pool[id] ? p.pool[id][kind] : 0);
      LPChart.stacked(box.querySelector("canvas"), points, {
        span: SPAN_S, yFormat: (v) => LP.fmt.num(v, 0), max: slot("total"),
        layers: [{ label: "KV", color: C.kv, value: slot("kv") },
                 { label: "adapter", color: C.adapter, value: slot("adapter") },
                 { label: "free", color: C.free, value: slot("free"), alpha: 0.9 }] });
    }
  }

  function poolBar(slots) {
    const pct = (n) => (slots.total ? (100 * n) / slots.total : 0) + "%";
    return LP.el("div", {},
      LP.el("div", { class: "bar" }, LP.el("span", { class: "kv", style: { width: pct(slots.kv) } }),
        LP.el("span", { class: "adapter", style: { width: pct(slots.adapter) } })),
      LP.el("div", { class: "bar-caption" },
        LP.el("span", { dataset: { field: "kv" } }, LP.fmt.int(slots.kv)), " · ",
        LP.el("span", { dataset: { field: "adapter" } }, LP.fmt.int(slots.adapter)), " · ",
        LP.el("span", { dataset: { field: "free" } }, LP.fmt.int(slots.free)), " of ",
        LP.el("span", { dataset: { field: "total" } }, LP.fmt.int(slots.total))));
  }

  function renderWorkers(workers) {
    const body = document.querySelector("#workers tbody");
    body.replaceChildren(...workers.map((w) => LP.el("tr", { dataset: { worker: w.id } },
      LP.el("td", { class: "mono" }, w.id),
      LP.el("td", {}, LP.el("span", { class: "badge " + (w.healthy ? "ok" : "bad"), dataset: { field: "health" } },
        w.healthy ? "healthy" : w.ready ? "stale" : "not ready")),
      LP.el("td", { class: "num", dataset: { field: "running" } }, LP.fmt.int(w.running), w.max_running ? LP.el("span", { class: "muted" }, " / " + w.max_running) : null),
      LP.el("td", { class: "num", dataset: { field: "waiting" } }, LP.fmt.int(w.waiting)),
      LP.el("td", {}, poolBar(w.slots)),
      LP.el("td", { class: "num", dataset: { field: "resident" } }, LP.fmt.int(w.resident_adapters)),
      LP.el("td", { class: "num", title: LP.fmt.bytes(w.adapter_load_bytes) + " copied" }, LP.fmt.int(w.adapter_loads)),
      LP.el("td", { class: "num" }, LP.fmt.int(w.preemptions)))));
    if (!workers.length) body.append(LP.el("tr", {}, LP.el("td", { colspan: 8, class: "muted" }, "no worker has reported yet")));
  }

  function adapterItem(row, tier) {
    const who = row.tenant ? row.tenant + "/" + row.name : row.name;
    const where = tier === "gpu" && row.workers.length ? " on " + row.workers.join(", ") : "";
    return LP.el("li", { dataset: { adapter: row.id }, title: row.id + where + " · rank " + row.rank },
      LP.el("span", { class: "name" }, who),
      LP.el("span", { class: "n", dataset: { field: "requests" } },
        LP.fmt.int(row.requests) + " req" + (row.active ? " · " + row.active + " now" : "")));
  }

  function renderTiers(adapters, arena) {
    for (const tier of ["gpu", "host", "disk"]) {
      LP.setText(`tier-${tier}-count`, LP.fmt.int(adapters.tiers[tier]), adapters.tiers[tier]);
      const rows = adapters.by_residency[tier];
      const list = document.getElementById(`tier-${tier}-list`);
      const items = rows.adapters.map((r) => adapterItem(r, tier));
      if (!rows.count) items.push(LP.el("li", { class: "empty" }, tier === "gpu" ? "none loaded" : "none held only here"));
      if (rows.count > rows.adapters.length) items.push(LP.el("li", { class: "muted" }, `… and ${LP.fmt.int(rows.count - rows.adapters.length)} more`));
      list.replaceChildren(...items);
    }
    LP.setText("registered-note", LP.fmt.int(adapters.registered) + " registered · base model " + LP.fmt.int(adapters.base_model_requests) + " req");
    LP.setText("arena-note", arena ? LP.fmt.bytes(arena.used_bytes) + " of " + LP.fmt.bytes(arena.capacity_bytes) +
      (arena.pinned_bytes ? " · " + LP.fmt.bytes(arena.pinned_bytes) + " pinned" : "") : "store not answering");
  }

  function renderTotals(s) {
    const r = s.requests;
    const sum = (o) => Object.values(o).reduce((a, b) => a + b, 0);
    LP.setText("total-requests", LP.fmt.int(r.total), r.total);
    const statuses = Object.entries(r.by_status).sort();
    LP.setText("total-by-status", statuses.length ? statuses.map(([k, v]) => k + ": " + LP.fmt.int(v)).join(" · ") : "–");
    LP.setText("total-generation-tokens", LP.fmt.int(r.generation_tokens), r.generation_tokens);
    LP.setText("total-prompt-tokens", LP.fmt.int(r.prompt_tokens), r.prompt_tokens);
    LP.setText("total-ttft-count", LP.fmt.int(s.latency.ttft.total_count), s.latency.ttft.total_count);
    LP.setText("total-rejections", LP.fmt.int(sum(r.rejections)), sum(r.rejections));
    LP.setText("total-aborts", LP.fmt.int(sum(r.aborts)), sum(r.aborts));
    LP.setText("e2e-p50", LP.fmt.ms(s.latency.e2e.p50_s), s.latency.e2e.p50_s);
  }

  document.addEventListener("DOMContentLoaded", () => {
    Object.assign(C, { kv: css("--kv"), adapter: css("--adapter"), free: "#2f3948", ok: css("--ok"),
                       host: css("--host"), bad: css("--bad") });
    document.addEventListener("lp-key-changed", () => { points = []; poll(); });
    window.addEventListener("resize", renderCharts);
    poll();
  });
})();
