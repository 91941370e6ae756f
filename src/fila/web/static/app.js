// fila serve: the list and a task's page follow the queue without a reload (docs/review-web.md).
// It only ever sets text (textContent), never markup: every string it shows came from a task's
// author or an engine. No inline script runs (the Content-Security-Policy allows this file only).
"use strict";

const POLL_MS = 3000;

function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
  return td;
}

async function getJSON(url) {
  const resp = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
  if (!resp.ok) throw new Error(url + ": " + resp.status);
  return resp.json();
}

function followList(table) {
  const url = table.dataset.poll;
  const body = table.tBodies[0];
  async function tick() {
    try {
      const got = await getJSON(url);
      const rows = [];
      for (const r of got.rows) {
        const tr = document.createElement("tr");
        tr.className = "st-" + r.status;
        const a = document.createElement("a");
        a.href = "/task/" + encodeURIComponent(r.id);
        a.textContent = r.id;
        cell(tr, "").appendChild(a);
        cell(tr, r.status + (r.error ? " (" + r.error + ")" : ""));
        cell(tr, r.engine);
        cell(tr, r.policy);
        const g = cell(tr, "");
        if (r.group) {
          const link = document.createElement("a");
          link.href = "/group/" + encodeURIComponent(r.group);
          link.textContent = r.group;
          g.appendChild(link);
        }
        cell(tr, r.submitted_at);
        cell(tr, r.diff);
        cell(tr, r.prompt, "prompt");
        rows.push(tr);
      }
      body.replaceChildren(...rows);
      document.getElementById("total").textContent = String(got.total);
      for (const a of document.querySelectorAll("#counts a[data-status]")) {
        const b = a.querySelector("b");
        if (b) b.textContent = String(got.counts[a.dataset.status] ?? 0);
      }
    } catch (e) {
      // The server may be restarting; the next tick tries again.
    }
    setTimeout(tick, POLL_MS);
  }
  setTimeout(tick, POLL_MS);
}

function followTask(box) {
  const status = document.getElementById("status");
  const decision = document.getElementById("decision");
  const log = document.getElementById("log");
  let offset = Number(box.dataset.logEnd || 0);
  async function tick() {
    try {
      const st = await getJSON(box.dataset.poll);
      if (st.status !== status.textContent) {
        status.textContent = st.status;
        status.className = "status st-" + st.status;
      }
      decision.textContent = st.decision;
      for (const [name, ok] of Object.entries(st.decidable)) {
        const form = document.getElementById(name + "-form");
        if (form) form.hidden = !ok;
      }
      if (st.status === "running" || st.status === "queued" || box.dataset.status === "running") {
        const got = await getJSON(box.dataset.log + "?offset=" + offset);
        if (got.offset < offset) log.textContent = "";
        if (got.text) log.appendChild(document.createTextNode(got.text));
        offset = got.offset;
      }
      box.dataset.status = st.status;
    } catch (e) {
      // As above: try again on the next tick.
    }
    setTimeout(tick, POLL_MS);
  }
  setTimeout(tick, POLL_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  const table = document.getElementById("tasks");
  if (table) followList(table);
  const box = document.getElementById("task");
  if (box) followTask(box);
});
