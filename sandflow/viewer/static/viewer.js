// sandflow view: live updates, expand/collapse, Ctrl+Enter in the SQL box.
// The server renders (and escapes) every fragment; this script never builds HTML from
// data, it only swaps in what the server sent.
"use strict";

function followLive(box) {
  const src = box.getAttribute("data-live-src");
  const every = Math.max(500, parseInt(box.getAttribute("data-poll-ms") || "2000", 10));
  let busy = false;
  let stopped = false;
  async function poll() {
    if (stopped || busy || document.hidden) return;
    busy = true;
    try {
      const resp = await fetch(src, { headers: { "Accept": "text/html" }, cache: "no-store" });
      if (resp.ok) {
        const html = await resp.text();
        const openFolds = new Set(
          Array.from(box.querySelectorAll("details[open]")).map((d) => d.closest("[data-turn]")?.getAttribute("data-turn"))
        );
        box.innerHTML = html;
        box.querySelectorAll("[data-turn]").forEach((t) => {
          if (openFolds.has(t.getAttribute("data-turn"))) t.querySelectorAll("details").forEach((d) => { d.open = true; });
        });
        if (box.querySelector("[data-live-done]")) {
          stopped = true;
          if (box.hasAttribute("data-reload-when-done")) window.location.reload();
        }
      }
    } catch (e) {
      // the server is gone or busy: try again at the next tick
    } finally {
      busy = false;
    }
  }
  const timer = setInterval(() => { if (stopped) clearInterval(timer); else poll(); }, every);
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-live-src]").forEach(followLive);
  document.querySelectorAll("[data-action=expand-all]").forEach((b) =>
    b.addEventListener("click", () => document.querySelectorAll(".turns details").forEach((d) => { d.open = true; }))
  );
  document.querySelectorAll("[data-action=collapse-all]").forEach((b) =>
    b.addEventListener("click", () => document.querySelectorAll(".turns details").forEach((d) => { d.open = false; }))
  );
  const sql = document.querySelector("form.sql textarea");
  if (sql) {
    sql.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) {
        ev.preventDefault();
        sql.form.requestSubmit();
      }
    });
  }
});
