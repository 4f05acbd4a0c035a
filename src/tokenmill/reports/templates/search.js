// Search for the data-overview page: filters domain cards and sample documents as you type.
// Plain DOM, no library, no network; the page's Content-Security-Policy admits this script by its hash.
(function () {
  "use strict";
  var input = document.getElementById("search");
  function openTarget() {
    // A link to a cell's samples (from the heatmap) should show them, even though they start folded.
    var id = decodeURIComponent(location.hash.slice(1));
    var target = id && document.getElementById(id);
    if (target && target.tagName === "DETAILS") target.open = true;
  }
  window.addEventListener("hashchange", openTarget);
  openTarget();
  if (!input) return;
  var status = document.getElementById("search-status");
  var cards = Array.prototype.slice.call(document.querySelectorAll(".domain-card"));
  var rows = Array.prototype.slice.call(document.querySelectorAll(".heat-row"));
  var index = null;
  function build() {
    // Lower-cased text is computed once, on the first search, so the page loads without this cost.
    index = cards.map(function (card) {
      return {
        card: card,
        domain: card.getAttribute("data-domain"),
        key: (card.getAttribute("data-search") || "").toLowerCase(),
        groups: Array.prototype.map.call(card.querySelectorAll("details.samples"), function (group) {
          return {
            el: group,
            samples: Array.prototype.map.call(group.querySelectorAll(".sample"), function (sample) {
              return { el: sample, text: sample.textContent.toLowerCase() };
            })
          };
        })
      };
    });
  }
  function count(n) {
    // 10000 -> "10,000", the same on every locale (the page's numbers are written that way).
    return String(n).replace(/\B(?=(\d{3})+(?!\d))/g, ",");
  }
  function matches(text, terms) {
    for (var i = 0; i < terms.length; i++) if (text.indexOf(terms[i]) < 0) return false;
    return true;
  }
  function apply() {
    if (!index) build();
    var query = input.value.trim().toLowerCase();
    var terms = query ? query.split(/\s+/) : [];
    var shownCards = 0, shownSamples = 0, totalSamples = 0, visibleDomains = {};
    index.forEach(function (entry) {
      var cardMatch = terms.length === 0 || matches(entry.key, terms);
      var any = false;
      entry.groups.forEach(function (group) {
        var hits = 0;
        group.samples.forEach(function (sample) {
          totalSamples++;
          var show = cardMatch || matches(sample.text, terms);
          sample.el.hidden = !show;
          if (show) { hits++; shownSamples++; }
        });
        if (hits) any = true;
        // Unfold groups that hold a match found in the text; fold them back when the search is cleared.
        if (terms.length && !cardMatch && hits) {
          if (!group.el.open) { group.el.open = true; group.el.setAttribute("data-search-opened", ""); }
        } else if (group.el.hasAttribute("data-search-opened")) {
          group.el.open = false;
          group.el.removeAttribute("data-search-opened");
        }
        group.el.hidden = terms.length > 0 && !cardMatch && !hits;
      });
      var show = cardMatch || any;
      entry.card.hidden = !show;
      if (show) { shownCards++; visibleDomains[entry.domain] = true; }
    });
    rows.forEach(function (row) {
      row.classList.toggle("dim", terms.length > 0 && !visibleDomains[row.getAttribute("data-row")]);
    });
    status.textContent = terms.length
      ? count(shownCards) + " of " + count(index.length) + " domains, " + count(shownSamples) + " of " +
        count(totalSamples) + " samples match"
      : count(index.length) + " domains, " + count(totalSamples) + " samples";
    // Which query the page now shows; tests wait on it, rather than on a timer.
    status.setAttribute("data-query", query);
  }
  var timer = null;
  input.addEventListener("input", function () {
    clearTimeout(timer);
    timer = setTimeout(apply, 80);
  });
  input.addEventListener("keydown", function (event) {
    if (event.key === "Escape") { input.value = ""; apply(); }
  });
  if (input.value) apply();
})();
