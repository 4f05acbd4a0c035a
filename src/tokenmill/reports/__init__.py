"""The public data-overview page and the run page."""
