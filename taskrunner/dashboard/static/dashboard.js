// Live pages without a build step: one EventSource per tab; on a change relevant to the
// page, re-fetch the page's fragment (?fragment=1) and swap it in, at most once a second.
// Pages with counts render the server's latest read of them and start a new one; a
// "fresh" event for the page (data-page) says it landed, and the page is fetched again.
"use strict";
(function () {
  const main = document.getElementById("main");
  const mode = main ? main.dataset.refresh : undefined;
  const MIN_GAP_MS = 1000;
  let last = 0;
  let timer = null;

  function fragmentUrl() {
    const url = new URL(window.location.href);
    url.searchParams.set("fragment", "1");
    return url;
  }

  async function refresh() {
    timer = null;
    last = Date.now();
    try {
      const response = await fetch(fragmentUrl(), { credentials: "same-origin" });
      if (response.ok) {
        main.innerHTML = await response.text();  // server-rendered and escaped
      }
    } catch (e) {
      // the next change or poll tries again
    }
    waitIfPending();
  }

  // A page still being read (data-pending) is fetched again every second until it fills in,
  // in case its "fresh" event came before this tab's event stream opened.
  function waitIfPending() {
    if (main.querySelector("[data-pending]")) schedule();
  }

  function schedule() {
    if (timer !== null) return;  // a refresh is already due: bursts coalesce into it
    timer = setTimeout(refresh, Math.max(0, last + MIN_GAP_MS - Date.now()));
  }

  // A task page also shows the states of the tasks it runs after and that run after it
  // (data-keys, a JSON list inside the swapped part, so it follows the page's content).
  function related(key) {
    const holder = main.querySelector("[data-keys]");
    if (!holder) return false;
    try { return JSON.parse(holder.dataset.keys).includes(key); } catch (e) { return false; }
  }

  function relevant(change) {
    if (change.kind === "fresh") return change.page === main.dataset.page;
    if (mode === "any") return true;
    if (mode === "key") return change.key === null || change.key === main.dataset.key || related(change.key);
    return false;
  }

  if (!main || !mode) return;
  waitIfPending();
  if (mode === "poll") {
    setInterval(schedule, 2000);  // the worker registry has no change stream: poll it gently
  }
  const source = new EventSource("/events");
  source.addEventListener("open", function () { document.body.dataset.live = "on"; });
  source.addEventListener("error", function () { document.body.dataset.live = "off"; });
  source.addEventListener("change", function (message) {
    let change;
    try { change = JSON.parse(message.data); } catch (e) { return; }
    if (relevant(change)) schedule();
  });
})();
