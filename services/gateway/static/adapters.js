// The adapters page: search the registry, read a card, upload from the browser, delete.
"use strict";

(() => {
  const MAX_ROWS = 500;  // rows drawn at once; the search narrows thousands down
  const NAME = /^[a-z0-9][a-z0-9._-]{0,63}$/;
  let cards = [];
  let selected = null;  // {name, tenant}
  let folderFiles = { config: null, model: null };
  let disarm = null;

  const $ = (id) => document.getElementById(id);

  const banner = LP.banner;

  async function load() {
    try {
      const listing = await LP.api("/v1/adapters");
      cards = listing.data.sort((a, b) => (a.tenant + "/" + a.name).localeCompare(b.tenant + "/" + b.name));
      if ($("banner").classList.contains("error")) banner("", "");
      render();
      if (selected) await showCard(selected.name, selected.tenant);
    } catch (error) {
      if (!LP.keyProblem(error)) banner("error", "Cannot list adapters: " + error.message);
      else banner("error", "Listing adapters needs the admin key (" + error.message + ").");
    }
  }

  function matches(card, words) {
    const hay = [card.name, card.tenant, card.id, card.sha256, card.residency, ...card.target_modules].join(" ").toLowerCase();
    return words.every((w) => hay.includes(w));
  }

  function render() {
    const words = $("search").value.toLowerCase().split(/\s+/).filter(Boolean);
    const found = cards.filter((c) => matches(c, words));
    const shown = found.slice(0, MAX_ROWS);
    $("match-count").textContent = found.length === cards.length ? `${LP.fmt.int(cards.length)} adapters`
      : `${LP.fmt.int(found.length)} of ${LP.fmt.int(cards.length)} match` + (found.length > MAX_ROWS ? ` · first ${MAX_ROWS} shown` : "");
    const body = document.querySelector("#adapters tbody");
    body.replaceChildren(...shown.map((c) => LP.el("tr", {
        class: "clickable" + (selected && selected.name === c.name && selected.tenant === c.tenant ? " selected" : ""),
        dataset: { name: c.name, tenant: c.tenant }, onclick: () => showCard(c.name, c.tenant) },
      LP.el("td", { class: "nowrap", dataset: { field: "name" } }, c.name),
      LP.el("td", { class: "nowrap" + (c.tenant ? "" : " muted") }, c.tenant || "shared"),
      LP.el("td", { class: "num" }, c.rank),
      LP.el("td", { class: "mono", title: c.target_modules.join(", ") }, c.target_modules.map((m) => m.replace(/_proj$/, "")).join(" ")),
      LP.el("td", { class: "num nowrap" }, LP.fmt.bytes(c.bytes)),
      LP.el("td", {}, LP.el("span", { class: "badge " + c.residency }, c.residency)))));
    if (!shown.length) body.append(LP.el("tr", {}, LP.el("td", { colspan: 6, class: "muted" },
      cards.length ? "no adapter matches" : "no adapter registered yet")));
  }

  async function showCard(name, tenant) {
    // A refresh of the same card keeps an armed delete armed; another card disarms it.
    if (!selected || selected.name !== name || selected.tenant !== tenant) resetDelete();
    selected = { name, tenant };
    try {
      const c = await LP.api(`/v1/adapters/${encodeURIComponent(name)}?tenant=${encodeURIComponent(tenant)}`);
      $("card-empty").classList.add("hidden");
      $("card-body").classList.remove("hidden");
      LP.setText("card-name", c.name);
      LP.setText("card-tenant", c.tenant || "shared (every tenant)");
      LP.setText("card-id", c.id);
      LP.setText("card-rank", String(c.rank), c.rank);
      LP.setText("card-targets", c.target_modules.join(", "));
      LP.setText("card-size", LP.fmt.bytes(c.bytes) + " (" + LP.fmt.int(c.bytes) + " bytes)", c.bytes);
      LP.setText("card-sha256", c.sha256);
      $("card-residency").replaceChildren(LP.el("span", { class: "badge " + c.residency }, c.residency),
        LP.el("span", { class: "muted" }, { gpu: " in a worker's GPU pool", host: " in the host RAM arena", disk: " on disk only" }[c.residency]));
      LP.setText("card-created", LP.fmt.date(c.created));
    } catch (error) {
      if (LP.keyProblem(error)) return;
      if (error.status === 404) { selected = null; $("card-body").classList.add("hidden"); $("card-empty").classList.remove("hidden"); }
      banner("error", `Cannot read ${name}: ${error.message}`);
    }
    render();
  }

  // ---- delete: the first click arms the button, a second one within 4 s deletes -------------------------

  function resetDelete() {
    clearTimeout(disarm);
    $("delete").classList.remove("armed");
    $("delete").textContent = "Delete";
    $("delete-note").textContent = "";
  }

  async function onDelete() {
    if (!selected) return;
    const button = $("delete");
    if (!button.classList.contains("armed")) {
      button.classList.add("armed");
      button.textContent = "Confirm delete";
      $("delete-note").textContent = "in-flight requests finish first";
      disarm = setTimeout(resetDelete, 4000);
      return;
    }
    resetDelete();
    const { name, tenant } = selected;
    try {
      await LP.api(`/v1/adapters/${encodeURIComponent(name)}?tenant=${encodeURIComponent(tenant)}`, { method: "DELETE" });
      selected = null;
      $("card-body").classList.add("hidden");
      $("card-empty").classList.remove("hidden");
      await load();
      banner("ok", `Deleted ${tenant ? tenant + "/" : ""}${name}.`);
    } catch (error) {
      if (!LP.keyProblem(error)) banner("error", `Cannot delete ${name}: ${error.message}`);
    }
  }

  // ---- upload ---------------------------------------------------------------------------------------

  function onFolder(event) {
    const files = [...event.target.files];
    // Only the folder's own two files: a nested checkpoint folder must not be picked by accident.
    const top = (f) => f.webkitRelativePath.split("/").length === 2;
    folderFiles = {
      config: files.find((f) => top(f) && f.name === "adapter_config.json") || null,
      model: files.find((f) => top(f) && f.name === "adapter_model.safetensors") || null,
    };
    const folder = files.length ? files[0].webkitRelativePath.split("/")[0] : "";
    const missing = ["config", "model"].filter((k) => !folderFiles[k]).map((k) => k === "config" ? "adapter_config.json" : "adapter_model.safetensors");
    $("upload-note").textContent = !files.length ? "" : missing.length ? `${folder}: missing ${missing.join(" and ")}` : `${folder}: both files found`;
    if (folder && !$("upload-name").value) {
      $("upload-name").value = folder.toLowerCase().replace(/[^a-z0-9._-]+/g, "-").replace(/^[^a-z0-9]+/, "").slice(0, 64);
    }
  }

  function chosen(inputId, fallback) {
    const files = $(inputId).files;
    return files && files.length ? files[0] : fallback;
  }

  function onUpload(event) {
    event.preventDefault();
    const name = $("upload-name").value.trim(), tenant = $("upload-tenant").value.trim();
    const config = chosen("upload-config", folderFiles.config), model = chosen("upload-model", folderFiles.model);
    const result = $("upload-result");
    const fail = (text) => { result.className = "banner error"; result.textContent = text; };
    if (!config || !model) return fail("Choose an adapter folder, or both adapter_config.json and adapter_model.safetensors.");
    if (!NAME.test(name)) return fail("The name must be 1-64 characters: lowercase letters, digits, '.', '_' or '-', starting with a letter or digit.");
    const form = new FormData();
    form.append("name", name);
    if (tenant) form.append("tenant", tenant);
    form.append("adapter_config", config, "adapter_config.json");
    form.append("adapter_model", model, "adapter_model.safetensors");

    // XMLHttpRequest rather than fetch: it reports upload progress, and adapters can be hundreds of MB.
    const xhr = new XMLHttpRequest();
    const bar = $("upload-progress");
    xhr.open("POST", "/v1/adapters");
    for (const [k, v] of Object.entries(LP.authHeaders())) xhr.setRequestHeader(k, v);
    xhr.upload.onprogress = (e) => { if (e.lengthComputable) bar.firstElementChild.style.width = (100 * e.loaded / e.total) + "%"; };
    xhr.onload = async () => {
      bar.classList.add("hidden");
      $("upload-button").disabled = false;
      let body = null;
      try { body = JSON.parse(xhr.responseText); } catch (e) { /* not JSON */ }
      if (xhr.status === 201 || xhr.status === 200) {
        result.className = "banner ok";
        result.textContent = (xhr.status === 201 ? "Added " : "Already registered with the same content: ") +
          `${body.tenant ? body.tenant + "/" : ""}${body.name} (rank ${body.rank}, ${LP.fmt.bytes(body.bytes)}, sha256 ${body.sha256.slice(0, 12)}…)`;
        $("upload-form").reset();
        folderFiles = { config: null, model: null };
        $("upload-note").textContent = "";
        selected = { name: body.name, tenant: body.tenant };
        await load();
        return;
      }
      const error = new LP.ApiError(xhr.status, body && body.error ? body.error.message : `HTTP ${xhr.status}`);
      if (LP.keyProblem(error)) return fail("Uploading needs the admin key: " + error.message);
      fail(`Upload refused (${xhr.status}): ${error.message}`);
    };
    xhr.onerror = () => { bar.classList.add("hidden"); $("upload-button").disabled = false; fail("The server did not answer the upload."); };
    result.className = "banner hidden";
    bar.firstElementChild.style.width = "0";
    bar.classList.remove("hidden");
    $("upload-button").disabled = true;
    xhr.send(form);
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("search").addEventListener("input", render);
    $("refresh").addEventListener("click", load);
    $("delete").addEventListener("click", onDelete);
    $("upload-folder").addEventListener("change", onFolder);
    $("upload-form").addEventListener("submit", onUpload);
    document.addEventListener("lp-key-changed", load);
    load();
  });
})();
