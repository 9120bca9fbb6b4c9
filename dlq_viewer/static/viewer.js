// Nemesis DLQ viewer: small enhancements over server-rendered pages.
// Everything works without this file except copying, live counts and live progress.
// Data from messages is only ever written with textContent, never as HTML.
"use strict";

(function () {
  function formatNumber(value) {
    return Number(value).toLocaleString("en-US");
  }

  // --- copy buttons ------------------------------------------------------------
  function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) {
      return navigator.clipboard.writeText(text);
    }
    var area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.className = "offscreen";
    document.body.appendChild(area);
    area.select();
    try {
      document.execCommand("copy");
    } finally {
      document.body.removeChild(area);
    }
    return Promise.resolve();
  }

  document.querySelectorAll("[data-copy]").forEach(function (button) {
    button.addEventListener("click", function () {
      var target = document.getElementById(button.getAttribute("data-copy"));
      if (!target) return;
      var label = button.textContent;
      copyText(target.textContent).then(
        function () { button.textContent = "Copied"; },
        function () { button.textContent = "Copy failed"; }
      ).then(function () {
        window.setTimeout(function () { button.textContent = label; }, 1500);
      });
    });
  });

  // --- confirmation dialog -------------------------------------------------------
  var dialog = document.getElementById("confirm-dialog");
  var pending = null;

  function askThenSubmit(form, submitter, message, danger) {
    if (!dialog || typeof dialog.showModal !== "function") {
      if (window.confirm(message)) submitForm(form, submitter);
      return;
    }
    document.getElementById("confirm-text").textContent = message;
    var ok = document.getElementById("confirm-ok");
    ok.className = danger ? "btn btn-danger-solid" : "btn btn-primary";
    ok.textContent = submitter && submitter.textContent ? submitter.textContent.trim() : "Confirm";
    pending = { form: form, submitter: submitter };
    dialog.showModal();
  }

  function submitForm(form, submitter) {
    form.dataset.confirmed = "yes";
    if (typeof form.requestSubmit === "function") {
      form.requestSubmit(submitter || undefined);
    } else {
      form.submit();
    }
  }

  if (dialog) {
    document.getElementById("confirm-ok").addEventListener("click", function () {
      dialog.close();
      if (pending) submitForm(pending.form, pending.submitter);
      pending = null;
    });
    document.getElementById("confirm-cancel").addEventListener("click", function () {
      pending = null;
      dialog.close();
    });
  }

  document.addEventListener("submit", function (event) {
    var form = event.target;
    var submitter = event.submitter || null;
    var source = submitter && submitter.hasAttribute("data-confirm") ? submitter : form;
    if (!source.hasAttribute || !source.hasAttribute("data-confirm")) return;
    if (form.dataset.confirmed === "yes") {
      delete form.dataset.confirmed;
      return;
    }
    event.preventDefault();
    var selected = form.querySelectorAll('input[name="ids"]:checked').length;
    var message = source.getAttribute("data-confirm").replace("{n}", formatNumber(selected));
    askThenSubmit(form, submitter, message, source.hasAttribute("data-confirm-danger"));
  });

  // --- row selection --------------------------------------------------------------
  document.querySelectorAll("form[data-selection]").forEach(function (form) {
    var all = form.querySelector("[data-select-all]");
    var boxes = function () {
      return Array.prototype.slice.call(form.querySelectorAll('input[name="ids"]:not(:disabled)'));
    };
    var counter = form.querySelector("[data-selection-count]");
    var update = function () {
      var checked = boxes().filter(function (box) { return box.checked; }).length;
      form.querySelectorAll("[data-needs-selection]").forEach(function (button) {
        button.disabled = checked === 0;
      });
      if (counter) {
        counter.hidden = checked === 0;
        counter.querySelector("[data-selected]").textContent = formatNumber(checked);
      }
      if (all) {
        var total = boxes().length;
        all.checked = total > 0 && checked === total;
        all.indeterminate = checked > 0 && checked < total;
      }
    };
    if (all) {
      all.addEventListener("change", function () {
        boxes().forEach(function (box) { box.checked = all.checked; });
        update();
      });
    }
    form.addEventListener("change", function (event) {
      if (event.target !== all) update();
    });
    update();
  });

  // --- custom time range ------------------------------------------------------------
  document.querySelectorAll("select[data-toggles]").forEach(function (select) {
    var prefix = select.getAttribute("data-toggles");
    var show = function () {
      var custom = select.value === "custom";
      ["from", "to"].forEach(function (part) {
        var field = document.getElementById(prefix + "-" + part);
        if (field) field.hidden = !custom;
      });
    };
    select.addEventListener("change", show);
    show();
  });

  // --- counts that take a while (text searches) ---------------------------------------
  document.querySelectorAll("[data-count-url]").forEach(function (element) {
    fetch(element.getAttribute("data-count-url"), {
      credentials: "same-origin",
      headers: { Accept: "application/json" }
    })
      .then(function (response) {
        if (!response.ok) throw new Error(String(response.status));
        return response.json();
      })
      .then(function (body) {
        element.textContent = formatNumber(body.count);
        var noun = element.parentNode.querySelector("[data-count-noun]");
        if (noun) noun.textContent = body.count === 1 ? "message matches" : "messages match";
      })
      .catch(function () { element.textContent = "?"; });
  });

  // --- bulk job progress ------------------------------------------------------------------
  document.querySelectorAll("[data-job-url]").forEach(function (card) {
    var url = card.getAttribute("data-job-url");
    var field = function (name) { return card.querySelector('[data-field="' + name + '"]'); };
    var poll = function () {
      fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (response) {
          if (!response.ok) throw new Error(String(response.status));
          return response.json();
        })
        .then(function (job) {
          field("state").textContent = job.state;
          field("state").className = "badge badge-" + job.state;
          field("done").textContent = formatNumber(job.done);
          field("expected").textContent = formatNumber(job.expected);
          field("rounds").textContent = formatNumber(job.rounds);
          field("percent").value = job.percent;
          if (job.error) {
            field("error").textContent = job.error;
            field("error").hidden = false;
          }
          if (job.finished) {
            var stop = document.querySelector("[data-job-stop]");
            if (stop) stop.hidden = true;
          } else {
            window.setTimeout(poll, 1000);
          }
        })
        .catch(function () { window.setTimeout(poll, 3000); });
    };
    window.setTimeout(poll, 500);
  });
})();
