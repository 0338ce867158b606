// The page of `rag serve` (rag/serve/page.py). Vanilla JavaScript, no dependencies, nothing fetched from elsewhere.
// Every text from the server (answers, passages, titles, errors) is inserted with textContent, never as HTML, so a
// passage holding markup shows it as text and runs nothing. The admin token and the API key live in their inputs only.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  let reader = null; // the reader's method, "rag" | "ralm", from /health

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function headers(token) {
    const h = { "Content-Type": "application/json" };
    if (token) h.Authorization = "Bearer " + token;
    return h;
  }

  function errorText(status, body) {
    const detail = body && (body.detail !== undefined ? body.detail : body.error && body.error.message);
    if (Array.isArray(detail)) {
      return status + ": " + detail.map((e) => (e.loc || []).join(".") + ": " + e.msg).join("; ");
    }
    return status + ": " + (detail || "request failed");
  }

  async function call(path, { method = "GET", body, token } = {}) {
    const resp = await fetch(path, { method, headers: headers(token), body: body === undefined ? undefined : JSON.stringify(body),
                                     credentials: "same-origin", cache: "no-store" });
    let data = null;
    try { data = await resp.json(); } catch (e) { data = null; }
    if (!resp.ok) throw new Error(errorText(resp.status, data));
    return data;
  }

  const apiKey = () => $("api-key").value.trim();

  // What /health says the server reads with: its method and its generator's kind (older servers: only "reader").
  const METHODS = { "rag-sequence": "RAG-Sequence", "rag-token": "RAG-Token", "in-context-ralm": "In-Context RALM",
                    "replug": "REPLUG" };
  function describe(h) {
    if (!h.method) return h.reader === "ralm" ? "causal LM (In-Context RALM / REPLUG)" : "RAG";
    const method = METHODS[h.method] || h.method;
    return method + (h.extractive ? " (extractive)" : "") + " · " + (h.generator_kind || "?") + " generator";
  }

  // ---------------------------------------------------------------- the knowledge-base version, kept current
  async function refreshHealth() {
    try {
      const h = await call("/health", { token: apiKey() });
      $("kb-version").textContent = h.kb_version;
      $("kb-passages").textContent = "(" + h.kb_passages + " passages, " + h.swaps + " swaps)";
      $("kb-history").textContent = (h.history || []).join(" → ") || "none";
      $("model-info").textContent = (h.model || "") + " · " + describe(h);
      if (reader !== h.reader) {
        reader = h.reader;
        document.body.classList.toggle("ralm", reader === "ralm");
      }
    } catch (e) {
      $("kb-version").textContent = "unavailable (" + e.message + ")";
    }
  }

  // ---------------------------------------------------------------- asking
  function number(id) {
    const v = $(id).value.trim();
    return v === "" ? undefined : Number(v);
  }

  function choice(id) {
    const v = $(id).value;
    return v === "" ? undefined : v;
  }

  // The body of POST /generate: only the options filled in; every other one is left to the model's stored settings.
  function request(question) {
    const body = { questions: [question], max_new_tokens: number("max-new-tokens"), min_new_tokens: number("min-new-tokens"),
                   num_beams: number("num-beams") };
    if (reader === "ralm") {
      body.ensemble = number("ensemble");
    } else {
      body.n_docs = number("n-docs");
      body.marginalization = choice("marginalization");
    }
    Object.keys(body).forEach((k) => body[k] === undefined && delete body[k]);
    return body;
  }
  window.ragPageRequest = request; // for the page tests: the body a question would be sent with

  function bar(kind, value) {
    const row = el("div", "bar-row");
    row.appendChild(el("span", "bar-label", kind));
    const track = el("div", "bar " + kind);
    const fill = el("div", "fill");
    const v = typeof value === "number" && isFinite(value) ? Math.max(0, Math.min(1, value)) : 0;
    fill.style.width = (100 * v).toFixed(1) + "%"; // CSSOM, which the page's Content-Security-Policy allows
    fill.dataset.value = String(value);
    track.appendChild(fill);
    row.appendChild(track);
    row.appendChild(el("span", "bar-value", typeof value === "number" ? value.toFixed(3) : "–"));
    return row;
  }

  // The answer's citations as the server chose them from the passages' probabilities (Answer.citations, rules in
  // rag/generation/answers.py), in number order; one naming no passage of this answer is left out, not drawn.
  function citations(answer) {
    const n = (answer.passages || []).length;
    return (Array.isArray(answer.citations) ? answer.citations : [])
      .filter((c) => c && Number.isInteger(c.number) && Number.isInteger(c.passage) && c.passage >= 0 && c.passage < n)
      .sort((a, b) => a.number - b.number);
  }
  window.ragPageCitations = citations; // for the page tests

  // [n] markers after the answer, each a link to its passage in the list below.
  function renderCitations(answer) {
    const box = $("answer-markers");
    box.replaceChildren();
    citations(answer).forEach((c) => {
      const link = el("a", "cite", "[" + c.number + "]");
      link.href = "#passage-" + c.passage;
      link.title = String(c.title || c.id || "");
      box.appendChild(link);
    });
  }

  function renderPassages(answer) {
    const list = $("passages");
    list.replaceChildren();
    const cited = new Map(citations(answer).map((c) => [c.passage, c.number]));
    (answer.passages || []).forEach((p, k) => {
      const item = el("li", "passage");
      item.id = "passage-" + k;
      const head = el("div", "passage-head");
      if (cited.has(k)) head.appendChild(el("span", "cite-badge", "[" + cited.get(k) + "]"));
      head.appendChild(el("span", "passage-title", p.title || p.id));
      head.appendChild(el("span", "passage-id muted", p.id));
      item.appendChild(head);
      item.appendChild(bar("prior", p.prior));
      if (p.posterior !== null && p.posterior !== undefined) item.appendChild(bar("posterior", p.posterior));
      item.appendChild(el("p", "passage-text", p.text));
      list.appendChild(item);
    });
  }

  function tokenText(t) {
    return String(t).replace(/^Ġ/, " ").replace(/^▁/, " ").replace(/Ċ/g, "\\n");
  }

  function renderHeatmap(answer) {
    const box = $("heatmap");
    box.replaceChildren();
    const grid = answer.token_doc_posterior;
    const tokens = answer.tokens;
    if (!grid || !tokens || !grid.length) {
      $("heatmap-note").textContent = answer.segments
        ? "In-Context RALM: the passage in context for each stretch of tokens — " +
          answer.segments.map((s) => "tokens " + s.start + "–" + s.end + ": " + s.title).join("; ")
        : "No per-token posterior for this answer (RAG-Token answers have one; choose marginalization token).";
      return;
    }
    $("heatmap-note").textContent = "Rows: passages; columns: generated tokens; darker = more of the token's probability from that passage.";
    const table = el("table", "heatmap");
    const head = el("tr");
    head.appendChild(el("th", "corner", ""));
    tokens.forEach((t) => head.appendChild(el("th", "token", tokenText(t))));
    table.appendChild(head);
    (answer.passages || []).forEach((p, k) => {
      const row = el("tr");
      row.appendChild(el("th", "doc", (k + 1) + ". " + (p.title || p.id)));
      grid.forEach((probs, t) => {
        const v = Number(probs[k]);
        const cell = el("td", "cell", v.toFixed(2));
        cell.style.backgroundColor = "rgba(29, 78, 216, " + Math.max(0, Math.min(1, v)).toFixed(3) + ")";
        if (v > 0.55) cell.classList.add("dark");
        cell.title = "p(z=" + (k + 1) + " | x, y_" + tokenText(tokens[t]) + ") = " + v.toFixed(4);
        row.appendChild(cell);
      });
      table.appendChild(row);
    });
    box.appendChild(table);
  }

  async function ask(event) {
    event.preventDefault();
    const question = $("question").value;
    if (!question.trim()) return;
    $("ask").disabled = true;
    $("ask-status").textContent = "asking…";
    const t0 = performance.now();
    try {
      const data = await call("/generate", { method: "POST", body: request(question), token: apiKey() });
      const answer = data.answers[0];
      $("answer").textContent = answer.text === "" ? "(empty answer)" : answer.text;
      $("answer-meta").textContent = "log p(y|x) = " + (typeof answer.score === "number" ? answer.score.toFixed(3) : "–") +
        " · knowledge base " + answer.kb_version + (answer.answered_with ? " · answered with " + answer.answered_with : "");
      renderCitations(answer);
      renderPassages(answer);
      renderHeatmap(answer);
      $("answer-section").hidden = false;
      $("answer-section").dataset.kbVersion = answer.kb_version;
      $("ask-status").textContent = "answered in " + ((performance.now() - t0) / 1000).toFixed(2) + " s";
    } catch (e) {
      $("ask-status").textContent = "error " + e.message;
    } finally {
      $("ask").disabled = false;
    }
  }

  // ---------------------------------------------------------------- hot swap
  async function swap(path, body) {
    const status = $("swap-status");
    status.textContent = "swapping…";
    status.classList.remove("error");
    try {
      const r = await call(path, { method: "POST", body, token: $("admin-token").value.trim() });
      status.textContent = r.kind + ": " + r.old_version + " → " + r.new_version + " in " + Number(r.seconds).toFixed(2) + " s";
    } catch (e) {
      status.textContent = "error " + e.message;
      status.classList.add("error");
    }
    await refreshHealth();
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("ask-form").addEventListener("submit", ask);
    $("swap-form").addEventListener("submit", (e) => { e.preventDefault(); swap("/admin/swap", { path: $("swap-path").value.trim() }); });
    $("swap-back").addEventListener("click", () => swap("/admin/swap_back", {}));
    $("api-key").addEventListener("change", refreshHealth);
    refreshHealth();
    setInterval(refreshHealth, 2000);
  });
})();
