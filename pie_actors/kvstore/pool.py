"""Page pool: refcounts, the free list, and the prefix index with its LRU of cached pages.

Every page is in exactly one state:

- free: refcount 0 and not indexed; allocated first.
- referenced: refcount > 0, held by one or more page tables.
- cached: refcount 0 but still indexed under its content key, so a later request can revive
  it; evicted (least recently released first) when the free list runs dry.
"""

from collections import Counter, OrderedDict, deque


class KVStoreError(Exception):
    """Base class of every error the KV store raises."""


class OutOfPages(KVStoreError):
    """Not enough free or evictable pages; the failed call changed nothing."""


class QuotaExceeded(OutOfPages):
    """The pages would take a partition's working sets past its bound (`KVStore.limit`); the
    failed call changed nothing."""


class UnknownSequence(KVStoreError):
    """The sequence id was never created or has been freed."""


class Evicted(UnknownSequence):
    """The sequence's pages left the pool (`KVStore.evict`) and it has not come back yet."""


class UnknownSaved(KVStoreError):
    """No saved working set of that name for that owner."""


class InvalidSlot(KVStoreError):
    """A slot or length outside what the sequence allows (frozen, beyond capacity, ...)."""


class PagePool:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self.free: deque[int] = deque(range(num_pages))
        self.cached: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self.index: dict[int, int] = {}  # content key -> page
        self.key_of: dict[int, int] = {}  # page -> content key, the inverse of index

    def available(self) -> int:
        """Pages an allocation may take: free ones, then evicted cached ones."""
        return len(self.free) + len(self.cached)

    def allocate(self, n: int) -> list[int]:
        """``n`` pages with refcount 1; all or nothing."""
        if n > self.available():
            raise OutOfPages(
                f"need {n} pages, only {len(self.free)} free and {len(self.cached)} evictable"
            )
        pages = []
        for _ in range(n):
            page = self.free.popleft() if self.free else self._evict()
            self.refcount[page] = 1
            pages.append(page)
        return pages

    def _evict(self) -> int:
        page, _ = self.cached.popitem(last=False)
        del self.index[self.key_of.pop(page)]
        return page

    def incref(self, page: int) -> None:
        """Add a reference; a cached page is revived (it leaves the eviction queue)."""
        if self.refcount[page] == 0:
            # The only unreferenced pages anyone can name are cached ones, found by lookup.
            del self.cached[page]
        self.refcount[page] += 1

    def decref(self, page: int) -> None:
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if page in self.key_of:
                self.cached[page] = None
            else:
                self.free.append(page)

    def register(self, page: int, key: int) -> None:
        """Index a full frozen page. When the key is already indexed (the same prefix was computed
        twice independently) the first page stays the shared one and this one stays private."""
        if key not in self.index:
            self.index[key] = page
            self.key_of[page] = key

    def lookup(self, key: int) -> int | None:
        return self.index.get(key)

    def is_cached(self, page: int) -> bool:
        return page in self.cached

    def is_free(self, page: int) -> bool:
        return self.refcount[page] == 0 and page not in self.cached

    def stats(self) -> dict[str, int]:
        free, cached = len(self.free), len(self.cached)
        return {
            "total": self.num_pages,
            "free": free,
            "referenced": self.num_pages - free - cached,
            "cached": cached,
        }

    def check(self, refs: Counter[int]) -> None:
        """Raise AssertionError unless the pool agrees with ``refs`` (page -> page-table references)."""
        pages = range(self.num_pages)
        free = set(self.free)
        if len(free) != len(self.free):
            raise AssertionError("a page is in the free list twice")
        stray = (free | set(self.cached) | set(refs)) - set(pages)
        if stray:
            raise AssertionError(f"page ids out of range [0, {self.num_pages}): {sorted(stray)}")
        for page in pages:
            rc = self.refcount[page]
            if rc != refs[page]:
                raise AssertionError(f"page {page}: refcount {rc} but {refs[page]} page-table references")
            states = {"free": page in free, "referenced": rc > 0, "cached": page in self.cached}
            if sum(states.values()) != 1:
                raise AssertionError(f"page {page} must be in exactly one state, found {states}")
            if page in free and page in self.key_of:
                raise AssertionError(f"page {page} is free but indexed")
            if page in self.cached and page not in self.key_of:
                raise AssertionError(f"page {page} is cached but not indexed")
        if len(self.index) != len(self.key_of) or any(self.key_of.get(p) != k for k, p in self.index.items()):
            raise AssertionError("prefix index and its inverse disagree")
