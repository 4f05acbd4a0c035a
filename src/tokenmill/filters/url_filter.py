"""URL filtering for web crawls: datatrove's URLFilter with the block lists it ships, and nothing fetched.

datatrove's `URLFilter` removes a document whose domain or subdomain is on its block list (4.5 million
adult, malware and similar domains from the UT1 lists, shipped inside datatrove as
`assets/url_filterblacklistsv0_3_0.tar.gz`), whose URL is on its URL list, or whose URL holds banned
words (`assets/banned_words.txt` and friends). The reasons are datatrove's: `domain`, `subdomain`,
`url`, `hard_blacklisted`, `soft_blacklisted`, `blacklisted_subword`.

Two things in it would reach for the network or a shared cache, and are configured away here:

* tldextract, which splits a URL into subdomain and registered domain, downloads the Public Suffix List
  on first use and caches it under the home folder. Here it is `TLDExtract(suffix_list_urls=(),
  cache_dir=None)`: the suffix list snapshot that ships inside tldextract, no download, no cache.
* The block-list archive is unpacked once per machine, under a file lock, into huggingface_hub's local
  assets folder (`cached_assets_path`: a path under HF_HOME; nothing is fetched). That happens in
  `setup()`, so a worker pays for it before its first batch rather than inside it.

Cost: the domain list is a Python set of 4.5 million strings, about 4 s and 0.7 GB per worker process
to load; the UrlFilter steps of a process that have the same parameters share one loaded filter.
Documents without a URL (JSON Lines input without a url field) are kept, or removed as `missing_url`
with `missing_url: remove`.
"""

from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING, Any

from tokenmill.filters.base import DocumentStep, Removal

if TYPE_CHECKING:
    from datatrove.pipeline.filters.url_filter import URLFilter

_LOADED: dict[str, Any] = {}
_LOCK = threading.Lock()


def _params_key(params: dict) -> str:
    return repr(
        sorted(
            (name, sorted(value) if isinstance(value, list | tuple | set) else value)
            for name, value in params.items()
        )
    )


def offline_url_filter(**params: Any) -> URLFilter:
    """A datatrove URLFilter with its lists loaded from the installed package and tldextract offline."""
    from datatrove.pipeline.filters.url_filter import URLFilter
    from tldextract import TLDExtract

    url_filter = URLFilter(**params)
    # tldextract's default downloads the Public Suffix List at the first URL; the bundled snapshot is used.
    url_filter.tldextractor = TLDExtract(cache_dir=None, suffix_list_urls=(), fallback_to_snapshot=True)
    url_filter.download_data()  # despite its name: unpacks the archive shipped inside datatrove
    return url_filter


class UrlFilter(DocumentStep):
    """datatrove's URLFilter as a curation step; parameters are datatrove's, plus `missing_url`."""

    stage = "url_filter"

    def __init__(
        self,
        soft_word_threshold: int = 2,
        extra_domains: list[str] | None = None,
        extra_urls: list[str] | None = None,
        banned_words: list[str] | None = None,
        banned_subwords: list[str] | None = None,
        soft_banned_words: list[str] | None = None,
        use_integrated_lists: bool = True,
        missing_url: str = "keep",
    ):
        if missing_url not in ("keep", "remove"):
            raise ValueError(f"missing_url must be keep or remove, not {missing_url!r}")
        self.params = {
            "soft_word_threshold": soft_word_threshold,
            "extra_domains": extra_domains,
            "extra_urls": extra_urls,
            "banned_words": banned_words,
            "banned_subwords": banned_subwords,
            "soft_banned_words": soft_banned_words,
            "use_integrated_lists": use_integrated_lists,
        }
        self.missing_url = missing_url
        self._filter = None

    def setup(self) -> None:
        key = _params_key(self.params)
        with _LOCK:  # one copy of the lists per process for all threads and steps with these parameters
            if key not in _LOADED:
                _LOADED[key] = offline_url_filter(**self.params)
        self._filter = _LOADED[key]

    def apply(self, documents: list[dict]) -> list[Removal | None]:
        from datatrove.data import Document

        if self._filter is None:
            self.setup()
        results: list[Removal | None] = []
        with warnings.catch_warnings():
            # datatrove reads tldextract's `registered_domain`, which tldextract 5.3+ renamed and warns about
            # at every URL; the property stays until tldextract 6, which pyproject.toml excludes.
            warnings.filterwarnings("ignore", "The 'registered_domain' property", DeprecationWarning)
            for document in documents:
                url = document.get("url")
                if not url:
                    missing = self.missing_url == "remove"
                    results.append(Removal("missing_url", {"filter": "url_filter"}) if missing else None)
                    continue
                verdict = self._filter.filter(Document(text="", id=document["id"], metadata={"url": url}))
                keep, reason = verdict if isinstance(verdict, tuple) else (verdict, None)
                results.append(
                    None if keep else Removal(reason or "blocked", {"filter": "url_filter", "url": url})
                )
        return results
