// Inside the sandboxed report frame: tell the parent page we are ready, replace this
// document with the report HTML it sends (only the parent's message is accepted), then
// tell the parent how tall the report is so it can show it without a second scrollbar.
// The frame never shows a scrollbar of its own: one that came and went would change the
// report's width, then its height, then the frame's, for ever.
(function () {
  "use strict";
  function postHeight() {
    var height = document.documentElement.scrollHeight;
    window.parent.postMessage({ kind: "bnrecal-report-height", height: height }, "*");
  }
  window.addEventListener("message", function (event) {
    if (event.source !== window.parent || !event.data || event.data.kind !== "bnrecal-report") return;
    document.open();
    document.write(String(event.data.html));
    document.close();
    document.documentElement.style.overflowY = "hidden";
    postHeight();
    if (window.ResizeObserver) new ResizeObserver(postHeight).observe(document.body);
  });
  window.parent.postMessage("bnrecal-report-frame-ready", "*");
})();
