// milpa-sessions operator console: countdowns, the live inbox, the signature confirmation.
// Vanilla JS, no build step. Text from the server is only ever set with textContent.
"use strict";

(function () {
  const body = document.body;
  const serverNow = Number(body.dataset.serverNow || Date.now());
  const skew = serverNow - Date.now(); // the server's clock decides deadlines

  // -- countdowns ---------------------------------------------------------------------------
  function remaining(ms) {
    const s = Math.floor(Math.abs(ms) / 1000);
    const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600);
    const m = Math.floor((s % 3600) / 60), sec = s % 60;
    const pad = (n) => String(n).padStart(2, "0");
    if (d > 0) return d + "d " + h + "h";
    if (h > 0) return h + "h " + pad(m) + "m";
    return m + "m " + pad(sec) + "s";
  }

  function tick() {
    const now = Date.now() + skew;
    document.querySelectorAll(".countdown[data-deadline]").forEach(function (el) {
      const deadline = Number(el.dataset.deadline);
      if (!deadline) return;
      const left = deadline - now;
      el.textContent = left > 0 ? remaining(left) + " left" : "expired " + remaining(left) + " ago";
      el.classList.toggle("overdue", left <= 0);
      el.classList.toggle("soon", left > 0 && left < 60000);
    });
  }
  tick();
  setInterval(tick, 1000);

  // -- a signature is given only after typing the operation's name ---------------------------
  const confirmInput = document.getElementById("confirm-operation");
  const signButton = document.getElementById("sign-and-answer");
  if (confirmInput && signButton) {
    const check = function () {
      signButton.disabled = confirmInput.value !== confirmInput.dataset.expect;
    };
    confirmInput.addEventListener("input", check);
    check();
  }

  // -- the live feed ---------------------------------------------------------------------------
  const page = body.dataset.page;
  if ((page !== "inbox" && page !== "session") || !window.EventSource) return;

  const list = document.getElementById("questions");
  const sessionEl = document.getElementById("session");
  const liveStatus = document.getElementById("live-status");
  let opened = false;

  function setLive(state, text) {
    if (!liveStatus) return;
    liveStatus.dataset.state = state;
    liveStatus.textContent = text;
  }

  function findRow(sessionId, questionId) {
    if (!list) return null;
    for (const row of list.querySelectorAll("li.question")) {
      if (row.dataset.session === sessionId && row.dataset.question === questionId) return row;
    }
    return null;
  }

  function sortKey(deadline, sessionId) {
    return [deadline === "" ? Number.MAX_SAFE_INTEGER : Number(deadline), sessionId];
  }

  function before(a, b) {
    return a[0] < b[0] || (a[0] === b[0] && a[1] < b[1]);
  }

  // A reason is the agent's text: as a class, `reason-<reason>` only for [a-z0-9_-] (else a
  // space in it would add a class, or throw), as console.app's `reason_class`.
  function reasonClass(reason) {
    const safe = typeof reason === "string" && /^[a-z0-9_-]+$/.test(reason);
    return safe ? "reason-" + reason : "reason-other";
  }

  function makeRow(c) {
    const tpl = document.getElementById("question-template");
    const row = tpl.content.firstElementChild.cloneNode(true);
    row.dataset.session = c.session_id;
    row.dataset.question = c.question_id;
    row.dataset.reason = c.reason;
    row.dataset.deadline = c.deadline_ms == null ? "" : String(c.deadline_ms);
    row.dataset.seq = String(c.seq);
    const badge = row.querySelector(".badge.reason");
    badge.textContent = c.reason;
    badge.classList.add(reasonClass(c.reason));
    const countdown = row.querySelector(".countdown");
    if (c.deadline_ms != null) {
      countdown.dataset.deadline = String(c.deadline_ms);
      countdown.setAttribute("datetime", c.expires_at);
    } else {
      countdown.classList.add("none");
      countdown.textContent = c.expires_at ? "never expires" : "no deadline";
    }
    const link = row.querySelector(".question-text");
    link.textContent = c.question;
    link.href = "/sessions/" + encodeURIComponent(c.session_id);
    row.querySelector(".session-id").textContent = c.session_id;
    row.querySelector(".mode").textContent = c.mode;
    row.querySelector(".goal").textContent = c.goal;
    const options = row.querySelector(".options");
    (c.options || []).forEach(function (o) {
      const span = document.createElement("span");
      span.className = "option";
      span.textContent = o;
      options.appendChild(span);
    });
    if (!c.options || !c.options.length) options.remove();
    row.classList.add("fresh");
    return row;
  }

  function adjustTotal(delta) {
    const total = document.getElementById("inbox-total");
    if (total) total.textContent = String(Math.max(0, Number(total.textContent) + delta));
    const empty = document.getElementById("inbox-empty");
    // (Not "nothing" while the page names entries it could not read.)
    if (empty) {
      empty.hidden =
        list.querySelector("li.question") !== null ||
        document.getElementById("inbox-unreadable") !== null;
    }
  }

  function onInbox(c) {
    const existing = findRow(c.session_id, c.question_id);
    if (c.status !== "open") {
      if (existing) {
        existing.classList.add("gone");
        setTimeout(function () { existing.remove(); adjustTotal(0); }, 400);
        adjustTotal(-1);
      }
      return;
    }
    const filter = list.dataset.reason;
    if (existing || (filter && filter !== c.reason)) return;
    const key = sortKey(c.deadline_ms == null ? "" : String(c.deadline_ms), c.session_id);
    const rows = Array.from(list.querySelectorAll("li.question"));
    let next = null;
    for (const row of rows) {
      if (before(key, sortKey(row.dataset.deadline, row.dataset.session))) { next = row; break; }
    }
    adjustTotal(1);
    // Past the last row of a page that has a next one: it belongs to a later page.
    if (next === null && list.dataset.hasNext === "true") return;
    list.insertBefore(makeRow(c), next);
    adjustTotal(0);
    tick();
  }

  function onSession(c) {
    if (c.session_id !== sessionEl.dataset.session) return;
    const stale = document.getElementById("stale");
    if (stale) stale.hidden = false;
  }

  const source = new EventSource("/api/v1/events");
  source.addEventListener("ready", function () {
    if (opened) { window.location.reload(); return; } // reconnected: changes may be missed
    opened = true;
    setLive("live", "live");
  });
  source.addEventListener("question", function (event) {
    let change;
    try { change = JSON.parse(event.data); } catch (e) { return; }
    if (list) onInbox(change);
    if (sessionEl) onSession(change);
  });
  source.addEventListener("resync", function () {
    if (list) window.location.reload();
    else if (document.getElementById("stale")) document.getElementById("stale").hidden = false;
  });
  source.addEventListener("error", function () {
    // Refused (a 429 past the caller's live streams, a 401 signed out): the browser gives up.
    if (source.readyState === EventSource.CLOSED) setLive("down", "live updates stopped: reload");
    else setLive("down", "reconnecting…");
  });
})();
