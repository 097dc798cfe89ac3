// webhook-gateway console: local times, and the overview's live refresh.
// Served by the gateway from /console/static/console.js (no inline script: the CSP
// forbids it). No framework, no build step.
"use strict";

// Every <time datetime=...> shows the viewer's local time; the UTC time stays in its
// title (shown on hover), as the server rendered it.
function localizeTimes(root) {
  const fmt = new Intl.DateTimeFormat(undefined, {
    year: "numeric", month: "2-digit", day: "2-digit",
    hour: "2-digit", minute: "2-digit", second: "2-digit",
    timeZoneName: "short",
  });
  for (const el of root.querySelectorAll("time[datetime]")) {
    const when = new Date(el.getAttribute("datetime"));
    if (!isNaN(when.getTime())) {
      el.textContent = fmt.format(when);
      el.classList.add("local");
    }
  }
}

// A form field with data-utc holds a UTC time as the server wrote it; it is shown in the
// viewer's time zone, as the lists are, with its offset (RFC 3339), which the server
// reads back exactly. One time zone on every page.
function localizeInputs(root) {
  const pad = (n) => String(Math.abs(n)).padStart(2, "0");
  for (const input of root.querySelectorAll("input[data-utc]")) {
    const when = new Date(input.value.trim().replace(" ", "T") + "Z");
    if (isNaN(when.getTime())) continue;
    const offset = -when.getTimezoneOffset();
    const local = new Date(when.getTime() + offset * 60000).toISOString().slice(0, 19);
    const sign = offset >= 0 ? "+" : "-";
    input.value = `${local}${sign}${pad(Math.trunc(offset / 60))}:${pad(offset % 60)}`;
    const label = input.closest("label");
    const tz = label && label.querySelector(".tz");
    if (tz) tz.textContent = "(your time zone)";
  }
}

// A button with data-confirm="question" asks before its form is sent (an action that is
// hard to take back: resending what was delivered, rotating a secret). Cancel sends
// nothing.
function confirmations(root) {
  root.addEventListener("submit", (event) => {
    const button = event.submitter;
    const question = button && button.getAttribute("data-confirm");
    if (question && !window.confirm(question)) {
      event.preventDefault();
    }
  });
}

// An element with data-refresh="URL" is replaced every few seconds by the HTML fragment
// at URL (rendered and escaped by the server). A failed fetch leaves the last numbers and
// marks them stale; a signed-out session stops the refresh.
function liveRefresh(el) {
  const url = el.getAttribute("data-refresh");
  const every = 5000;
  async function tick() {
    try {
      const response = await fetch(url, { credentials: "same-origin", redirect: "manual" });
      if (response.type === "opaqueredirect" || response.status === 403) {
        el.classList.add("stale");
        return; // signed out: no more polling
      }
      if (!response.ok) throw new Error("HTTP " + response.status);
      const html = await response.text();
      const fresh = new DOMParser().parseFromString(html, "text/html");
      el.replaceChildren(...fresh.body.childNodes);
      el.classList.remove("stale");
      localizeTimes(el);
    } catch (e) {
      el.classList.add("stale");
    }
    setTimeout(tick, every);
  }
  setTimeout(tick, every);
}

// A page reached after an action says what was done once (`?done=...`): the parameter
// leaves the address bar, so a reload or a bookmark does not repeat a stale notice.
function forgetDone() {
  const url = new URL(window.location.href);
  if (url.searchParams.has("done")) {
    url.searchParams.delete("done");
    window.history.replaceState(null, "", url.pathname + url.search + url.hash);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  forgetDone();
  localizeTimes(document);
  localizeInputs(document);
  confirmations(document);
  for (const el of document.querySelectorAll("[data-refresh]")) liveRefresh(el);
});
