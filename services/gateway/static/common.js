// Shared by the loraplex pages: the admin key (sessionStorage), API calls, safe DOM building, formatting.
"use strict";

const LP = (() => {
  const KEY_NAME = "loraplex.adminKey";

  class ApiError extends Error {
    constructor(status, message, code) { super(message); this.status = status; this.code = code; }
    get isAuth() { return this.status === 401 || this.status === 403; }
  }

  function key() { return sessionStorage.getItem(KEY_NAME) || ""; }

  function setKey(value) {
    if (value) sessionStorage.setItem(KEY_NAME, value); else sessionStorage.removeItem(KEY_NAME);
    updateKeyButton();
    document.dispatchEvent(new CustomEvent("lp-key-changed"));
  }

  function authHeaders() { return key() ? { Authorization: "Bearer " + key() } : {}; }

  // The OpenAI-style error body's message, else the status line.
  async function errorOf(response) {
    let message = response.status + " " + response.statusText, code = null;
    try {
      const body = await response.json();
      if (body && body.error) { message = body.error.message || message; code = body.error.code; }
    } catch (e) { /* not JSON */ }
    return new ApiError(response.status, message, code);
  }

  async function api(path, options = {}) {
    const headers = Object.assign({}, authHeaders(), options.headers || {});
    let response;
    try {
      response = await fetch(path, Object.assign({}, options, { headers, cache: "no-store" }));
    } catch (e) {
      throw new ApiError(0, "the server does not answer (" + e.message + ")", "unreachable");
    }
    if (!response.ok) throw await errorOf(response);
    if (response.status === 204) return null;
    const type = response.headers.get("content-type") || "";
    return type.includes("json") ? response.json() : response.text();
  }

  // el("td", {class: "num", dataset: {field: "kv"}}, "12") -- text only, never HTML, so names cannot inject markup.
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "class") node.className = value;
      else if (name === "dataset") Object.assign(node.dataset, value);
      else if (name === "style") Object.assign(node.style, value);
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else node.setAttribute(name, value === true ? "" : value);
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function setText(id, text, value) {
    const node = document.getElementById(id);
    if (!node) return;
    node.textContent = text;
    if (value !== undefined) node.dataset.value = value === null ? "" : String(value);
  }

  // The page's message line: kind "error" or "ok" colours it; empty text hides it.
  function banner(kind, text) {
    const node = document.getElementById("banner");
    node.className = "banner " + kind;
    node.textContent = text;
    if (!text) node.classList.add("hidden");
  }

  const fmt = {
    int(n) { return n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US"); },
    num(x, digits = 1) {
      if (x === null || x === undefined || !isFinite(x)) return "–";
      if (Math.abs(x) >= 1000) return Math.round(x).toLocaleString("en-US");
      return x.toFixed(Math.abs(x) >= 100 ? 0 : digits);
    },
    ms(seconds) {
      if (seconds === null || seconds === undefined || !isFinite(seconds)) return "–";
      const ms = seconds * 1000;
      if (ms >= 1000) return (ms / 1000).toFixed(ms >= 10000 ? 0 : 1) + " s";
      return (ms >= 100 ? ms.toFixed(0) : ms >= 10 ? ms.toFixed(1) : ms.toFixed(2)) + " ms";
    },
    bytes(n) {
      if (n === null || n === undefined) return "–";
      const units = ["B", "KiB", "MiB", "GiB", "TiB"];
      let i = 0, x = n;
      while (x >= 1024 && i < units.length - 1) { x /= 1024; i++; }
      return (i === 0 ? x.toFixed(0) : x.toFixed(x >= 100 ? 0 : 1)) + " " + units[i];
    },
    duration(seconds) {
      const s = Math.floor(seconds);
      if (s < 60) return s + "s";
      if (s < 3600) return Math.floor(s / 60) + "m " + (s % 60) + "s";
      if (s < 86400) return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
      return Math.floor(s / 86400) + "d " + Math.floor((s % 86400) / 3600) + "h";
    },
    date(unix) { return unix ? new Date(unix * 1000).toLocaleString() : "–"; },
  };

  // ---- the admin key panel in the header ---------------------------------------------------------

  let onKeyNeeded = null;

  function updateKeyButton() {
    const button = document.getElementById("key-button");
    if (button) button.textContent = key() ? "Admin key ✓" : "Admin key";
  }

  function showKeyPanel(reason) {
    const panel = document.getElementById("key-panel");
    panel.classList.remove("hidden");
    document.getElementById("key-message").textContent = reason || "";
    document.getElementById("key-input").focus();
  }

  function hideKeyPanel() { document.getElementById("key-panel").classList.add("hidden"); }

  // An API call refused for its key opens the panel with the server's own words.
  function keyProblem(error) {
    if (!error.isAuth) return false;
    const why = error.status === 403 ? "That key is not an admin key: " + error.message
      : key() ? "The server refused this key: " + error.message : "This server has API keys on: enter the admin key.";
    showKeyPanel(why);
    return true;
  }

  function mountHeader() {
    updateKeyButton();
    document.getElementById("key-button").addEventListener("click", () => {
      const panel = document.getElementById("key-panel");
      if (panel.classList.contains("hidden")) showKeyPanel(""); else hideKeyPanel();
    });
    document.getElementById("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const input = document.getElementById("key-input");
      setKey(input.value.trim());
      input.value = "";
      hideKeyPanel();
    });
    document.getElementById("key-forget").addEventListener("click", () => { setKey(""); hideKeyPanel(); });
  }

  document.addEventListener("DOMContentLoaded", mountHeader);

  return { ApiError, api, authHeaders, banner, el, setText, fmt, key, setKey, keyProblem, errorOf };
})();
