// The head atlas, drawn from the JSON beside it: the grid coloured by the score the menu picks, a card per
// head on click, a search by head name (or label), and the table of every head, sorted by a clicked column.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("atlas-data").textContent);
  const scores = data.scores;
  const metrics = Object.keys(scores);
  const menu = document.getElementById("atlas-score");
  const grid = document.getElementById("atlas-grid");
  const card = document.getElementById("atlas-card");
  const search = document.getElementById("atlas-search");
  const legend = document.getElementById("atlas-legend");
  const heads = [];
  for (let l = 0; l < data.n_layers; l++) for (let h = 0; h < data.n_heads; h++) heads.push("L" + l + "H" + h);
  const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const RDBU = [[33, 102, 172], [146, 197, 222], [247, 247, 247], [244, 165, 130], [178, 24, 43]];

  function fmt(v) {
    if (v === null || v === undefined || !Number.isFinite(v)) return "";
    return String(Number(v.toPrecision(3)));
  }
  function el(tag, text, attrs) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = text;
    for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
    return e;
  }
  function ramp(stops, t) {
    const x = Math.min(1, Math.max(0, t)) * (stops.length - 1);
    const i = Math.min(stops.length - 2, Math.floor(x));
    const f = x - i;
    const c = stops[i].map((a, j) => Math.round(a + f * (stops[i + 1][j] - a)));
    return "rgb(" + c.join(",") + ")";
  }
  function colourer(metric) {
    const values = Object.values(scores[metric] || {}).map((v) => v[0]).filter((v) => v !== null);
    const signed = data.signed.indexOf(metric) >= 0;
    const lo = Math.min(...values), hi = Math.max(...values);
    const span = signed ? Math.max(Math.abs(lo), Math.abs(hi)) || 1 : hi - lo || 1;
    legend.textContent = signed
      ? "blue " + fmt(-span) + " .. white 0 .. red " + fmt(span)
      : "dark " + fmt(lo) + " .. yellow " + fmt(hi);
    return (v) => (v === null ? "#ddd" : signed ? ramp(RDBU, (v / span + 1) / 2) : ramp(VIRIDIS, (v - lo) / span));
  }
  function labelsOf(head) {
    return data.labels[head] || [];
  }

  // the grid, as wide as the page: layers across where a model has more layers than heads (smollm2: 30 x 9)
  const across = data.n_layers > data.n_heads;
  const nRows = across ? data.n_heads : data.n_layers;
  const nCols = across ? data.n_layers : data.n_heads;
  const nameAt = (r, c) => (across ? "L" + c + "H" + r : "L" + r + "H" + c);
  // a label most heads share is a mark in the cell's corner, the rarer ones their codes: every code in the legend
  const counts = {};
  for (const name of heads) for (const [label] of labelsOf(name)) counts[label] = (counts[label] || 0) + 1;
  const common = new Set(Object.keys(counts).filter((label) => counts[label] > (data.common || 0.5) * heads.length));
  const MARK = "\u2022";
  function codeOf(label) {
    return (data.codes || {})[label] || label.slice(0, 3).toUpperCase();
  }
  const header = el("tr");
  header.appendChild(el("th", "", { class: "corner" }));
  for (let c = 0; c < nCols; c++) header.appendChild(el("th", (across ? "L" : "H") + c));
  grid.appendChild(header);
  const cells = {};
  for (let r = 0; r < nRows; r++) {
    const tr = el("tr");
    tr.appendChild(el("th", (across ? "H" : "L") + r));
    for (let c = 0; c < nCols; c++) {
      const name = nameAt(r, c);
      const td = el("td", "", { "data-head": name });
      const labels = labelsOf(name);
      if (labels.length) {
        const rare = labels.filter((x) => !common.has(x[0]));
        if (rare.length) td.appendChild(el("span", rare.map((x) => codeOf(x[0])).join(" "), { class: "code" }));
        if (rare.length < labels.length) td.appendChild(el("span", MARK, { class: "mark" }));
        td.title = name + "\n" + labels.map((x) => x[0] + ": " + x[1]).join("\n");
      }
      td.addEventListener("click", () => open(name));
      cells[name] = td;
      tr.appendChild(td);
    }
    grid.appendChild(tr);
  }
  const legendOfCodes = document.getElementById("atlas-codes");
  if (legendOfCodes) {
    const order = Object.keys(counts).sort((a, b) => counts[a] - counts[b] || a.localeCompare(b));
    for (const label of order) {
      const item = el("span", null, { "data-label": label });
      item.appendChild(el("b", common.has(label) ? MARK : codeOf(label)));
      const most = common.has(label) ? ", most heads: a mark in the corner" : "";
      item.appendChild(document.createTextNode(" " + label + " (" + counts[label] + " of " + heads.length + most + ")"));
      legendOfCodes.appendChild(item);
    }
    if (!order.length) legendOfCodes.textContent = "no head passed a class rule";
  }

  function recolour() {
    const metric = menu.value;
    const colour = colourer(metric);
    for (const name of heads) {
      const v = (scores[metric] || {})[name];
      const value = v ? v[0] : null;
      const td = cells[name];
      td.style.background = colour(value);
      td.style.color = "#000";
      td.dataset.value = value === null ? "" : String(value);
      if (!labelsOf(name).length) td.title = name + " " + metric + " " + fmt(value);
    }
  }
  for (const m of metrics) menu.appendChild(el("option", m, { value: m }));
  menu.addEventListener("change", recolour);

  function link(name) {
    const a = el("a", name, { "data-head": name });
    a.addEventListener("click", () => open(name));
    return a;
  }
  function patternSvg(name) {
    const p = (data.patterns || {})[name];
    const tokens = data.tokens || [];
    if (!p) return el("p", "no pattern");
    const size = 14, pad = 70, top = 4, n = p.length;
    const ns = "http://www.w3.org/2000/svg";
    const svg = document.createElementNS(ns, "svg");
    svg.setAttribute("width", pad + n * size);
    svg.setAttribute("height", top + n * size);
    svg.setAttribute("class", "pattern");
    for (let q = 0; q < n; q++) {
      const t = document.createElementNS(ns, "text");
      t.setAttribute("x", pad - 3);
      t.setAttribute("y", top + q * size + size - 3);
      t.setAttribute("text-anchor", "end");
      t.setAttribute("font-size", "9");
      t.textContent = JSON.stringify(tokens[q] || "").slice(1, -1).slice(0, 10);
      svg.appendChild(t);
      for (let k = 0; k <= q && k < p[q].length; k++) {
        const r = document.createElementNS(ns, "rect");
        r.setAttribute("x", pad + k * size);
        r.setAttribute("y", top + q * size);
        r.setAttribute("width", size);
        r.setAttribute("height", size);
        const a = p[q][k] / 1000;
        r.setAttribute("fill", ramp(VIRIDIS, a));
        const tip = document.createElementNS(ns, "title");
        tip.textContent = JSON.stringify(tokens[q]) + " -> " + JSON.stringify(tokens[k]) + ": " + fmt(a);
        r.appendChild(tip);
        svg.appendChild(r);
      }
    }
    return svg;
  }
  function tokenList(title, rows, what) {
    const box = el("div");
    box.appendChild(el("h4", title));
    if (!rows || !rows.length) return box;
    box.appendChild(el("p", rows.map((r) => JSON.stringify(r[0]) + " " + what + fmt(r[1])).join(", ")));
    return box;
  }

  function open(name) {
    for (const n of heads) cells[n].classList.toggle("picked", n === name);
    card.hidden = false;
    card.replaceChildren();
    card.setAttribute("data-head", name);
    card.appendChild(el("h3", name));
    const labels = labelsOf(name);
    const why = el("ul", null, { class: "labels" });
    for (const [label, rule] of labels) why.appendChild(el("li", label + ": " + rule));
    if (!labels.length) why.appendChild(el("li", "no label: no class rule passed"));
    card.appendChild(why);
    const table = el("table", null, { class: "scores" });
    table.appendChild(el("tr")).append(...["score", "value", "95% interval", "rank", "n", "partner"].map((t) => el("th", t)));
    for (const m of metrics) {
      const v = scores[m][name];
      if (!v) continue;
      const tr = el("tr", null, { "data-metric": m });
      const interval = v[1] === null ? "" : fmt(v[1]) + " .. " + fmt(v[2]);
      tr.append(el("td", m, { class: "text" }), el("td", fmt(v[0])), el("td", interval),
        el("td", v[3] === null ? "" : v[3] + " / " + Object.keys(scores[m]).length), el("td", v[4] === null ? "" : String(v[4])));
      const cell = el("td", null, { class: "text" });
      if (v[5]) cell.appendChild(link(v[5]));
      tr.appendChild(cell);
      table.appendChild(tr);
    }
    card.appendChild(table);
    const partners = (data.partners || {})[name] || {};
    if (Object.keys(partners).length) {
      card.appendChild(el("h4", "composition partners (in: writers it reads; out: readers of it)"));
      const list = el("ul", null, { class: "partners" });
      for (const key of Object.keys(partners).sort()) {
        const li = el("li", key.replace("_", " ") + ": ");
        partners[key].forEach(([other, s], i) => {
          if (i) li.appendChild(document.createTextNode(", "));
          li.appendChild(link(other));
          li.appendChild(document.createTextNode(" " + fmt(s)));
        });
        list.appendChild(li);
      }
      card.appendChild(list);
    }
    card.appendChild(el("h4", "attention on the example prompt (query down, key across)"));
    card.appendChild(patternSvg(name));
    attribution(name);
    card.appendChild(tokenList("attends to most on the text (share of its attention)", (data.attends || {})[name], ""));
    card.appendChild(tokenList("logit lens of its mean output on the text (W_O then W_U; weak where it rests on the first token)", (data.writes || {})[name], "logit "));
  }

  // a component: a head's name links to its card; the embedding, an MLP and the biases are text
  function component(name) {
    return /^L\d+H\d+$/.test(name) ? link(name) : el("span", name);
  }
  function parts(title, rows) {
    const box = el("div", null, { class: "split" });
    box.appendChild(el("b", title + ": "));
    (rows || []).forEach(([who, v], i) => {
      if (i) box.appendChild(document.createTextNode(", "));
      box.appendChild(component(who));
      box.appendChild(document.createTextNode(" " + fmt(v)));
    });
    return box;
  }
  function attribution(name) {
    const why = (data.attribution || {})[name];
    if (why) {
      const [q, k, w] = why.edge;
      card.appendChild(el("h4", "why it attends there (QK attribution, exact at the clean run's norm scales)"));
      card.appendChild(el("p", "its typical edge on the example prompt: query " + q + " " + JSON.stringify(why.tokens[0]) +
        " to key " + k + " " + JSON.stringify(why.tokens[1]) + ", attention " + fmt(w) + ", score " + fmt(why.score) +
        " (before the softmax, the norms' scales held: each side's parts add up to it)", { class: "edge" }));
      card.appendChild(parts("builds the query", why.query));
      card.appendChild(parts("builds the key", why.key));
      if (why.removal) {
        const [who, held, free, scale, qkScale] = why.removal;
        const line = el("p", null, { class: "edge" });
        line.append(document.createTextNode("taken out of the query side, "), component(who),
          document.createTextNode(" lowers the score by " + fmt(held) + " with the norms' scales held (its split) and by " +
            fmt(free) + " with them free (input norm's scale " + fmt(100 * scale) + "%" +
            (qkScale === null ? "" : ", QK-norm's up to " + fmt(100 * qkScale) + "%") + ")"));
        card.appendChild(line);
      }
      const pairs = el("div", null, { class: "split" });
      pairs.appendChild(el("b", "largest pairs (query x key): "));
      why.pairs.forEach(([a, b, v], i) => {
        if (i) pairs.appendChild(document.createTextNode(", "));
        pairs.append(component(a), document.createTextNode(" x "), component(b), document.createTextNode(" " + fmt(v)));
      });
      card.appendChild(pairs);
      card.appendChild(el("h4", "what it writes there (its output at that query, |output| " + fmt(why.norm) + ")"));
      card.appendChild(el("p", "through the final norm at its clean scale, it raises most: " +
        why.writes.map((r) => JSON.stringify(r[0]) + " " + fmt(r[1])).join(", "), { class: "writes" }));
      card.appendChild(parts("its values written by (share of |output| along it)", why.values));
    }
    const maps = (data.maps || {})[name];
    if (maps && maps.length) {
      card.appendChild(el("h4", "maps this text's tokens to (weights only: E W_OV W_U as MAPS computes it, over the text's tokens, not MAPS's whole vocabulary; amplification x)"));
      const list = el("ul", null, { class: "maps" });
      for (const [src, amp, targets] of maps) {
        list.appendChild(el("li", JSON.stringify(src) + " (x" + fmt(amp) + ") -> " + targets.map((t) => JSON.stringify(t)).join(", ")));
      }
      card.appendChild(list);
    }
  }

  // every head, sortable
  const list = document.getElementById("atlas-heads");
  const columns = ["head", "labels", ...metrics];
  const rows = heads.map((name) => [name, labelsOf(name).map((x) => x[0]).join(", "),
    ...metrics.map((m) => (scores[m][name] ? scores[m][name][0] : null))]);
  let order = null;
  function drawList() {
    const words = search.value.toLowerCase().split(/\s+/).filter(Boolean);
    let shown = rows.filter((r) => words.every((w) => (r[0] + " " + r[1]).toLowerCase().split(/[\s,]+/).some((x) => x === w || x.startsWith(w + "h") || (!/^l\d/.test(x) && x.startsWith(w)))));
    if (order) {
      const [c, dir] = order;
      shown = shown.slice().sort((a, b) => {
        const x = a[c], y = b[c];
        if (x === null || x === "") return 1;
        if (y === null || y === "") return -1;
        return (typeof x === "number" ? x - y : String(x).localeCompare(String(y))) * dir;
      });
    }
    const body = list.querySelector("tbody");
    body.replaceChildren();
    for (const r of shown) {
      const tr = el("tr", null, { "data-head": r[0] });
      const first = el("td", null, { class: "text" });
      first.appendChild(link(r[0]));
      tr.append(first, el("td", r[1], { class: "text" }), ...r.slice(2).map((v) => el("td", fmt(v))));
      body.appendChild(tr);
    }
    const keep = new Set(shown.map((r) => r[0]));
    for (const n of heads) cells[n].classList.toggle("dim", words.length > 0 && !keep.has(n));
  }
  const head = el("tr");
  columns.forEach((c, i) => {
    const th = el("th", c);
    th.addEventListener("click", () => {
      order = order && order[0] === i ? [i, -order[1]] : [i, i < 2 ? 1 : -1];
      drawList();
    });
    head.appendChild(th);
  });
  list.querySelector("thead").appendChild(head);
  search.addEventListener("input", drawList);
  search.addEventListener("keydown", (e) => {
    const name = search.value.trim().toUpperCase();
    if (e.key === "Enter" && cells[name]) open(name);
  });
  recolour();
  drawList();
})();
