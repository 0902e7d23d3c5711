"""An SGLang HiCache storage backend on kvtide (the interface of SGLang 0.5.23).

Use it as SGLang's dynamic backend::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvtide", "module_path": "kvtide.sglang", "class_name": "KvtideHiCacheStorage",
        "interface_v1": 1, "kvtide_address": "unix:/run/kvtide/owner.sock"}'

``kvtide_address`` (or ``KVTIDE_ADDRESS``) names a ``kvtide-owner``; without one each rank opens
kvtide embedded, with ``kvtide_settings`` (a dict of ``kvtide.Store`` keywords) and the
``KVTIDE_*`` setting variables. Keys follow Mooncake's backend, so both lay out a page the same
way: an MHA page is two objects, ``{hash}_{tp_rank}_k`` and ``{hash}_{tp_rank}_v`` (with
``_{pp_rank}`` after the rank under pipeline parallelism); an MLA page is one, ``{hash}_{suffix}_k``.
The zero-copy path (``interface_v1``) reads and writes the host pool's pages in place through
``mem_pool_host.get_page_buffer_meta``.
"""

import os
from typing import Any, List, Optional

import kvtide

try:  # SGLang's factory checks issubclass against its own base class.
    from sglang.srt.mem_cache.hicache_storage import (  # type: ignore
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
    )
except ImportError:  # pragma: no cover - exercised whenever SGLang is absent (CI)
    from kvtide._sglang_base import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

__all__ = ["KvtideHiCacheStorage", "HiCacheStorageConfig", "HiCacheStorageExtraInfo"]


def _rank_suffixes(config):
    tp = getattr(config, "tp_rank", 0)
    pp_size = getattr(config, "pp_size", 1) or 1
    pp = getattr(config, "pp_rank", 0)
    if pp_size > 1:
        return f"{tp}_{pp}", f"{pp}"
    return f"{tp}", ""


class KvtideHiCacheStorage(HiCacheStorage):
    """HiCache pages in kvtide. ``batch_exists`` counts the leading pages whose objects all
    exist; ``batch_get_v1`` / ``batch_set_v1`` answer one bool per page and never raise."""

    def __init__(self, storage_config: Optional[HiCacheStorageConfig] = None, *_args: Any, store=None):
        self.config = storage_config
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.is_mla = bool(getattr(storage_config, "is_mla_model", False))
        mha, mla = _rank_suffixes(storage_config)
        self.suffix = mla if self.is_mla else mha
        self.mem_pool_host = None
        if store is not None:
            self.store = store
        else:
            address = extra.get("kvtide_address") or os.environ.get("KVTIDE_ADDRESS")
            if address:
                self.store = kvtide.connect(address)
            else:
                self.store = kvtide.Store(env=True, **extra.get("kvtide_settings", {}))

    # ---- keys ---------------------------------------------------------------------------------

    def _objects(self, keys: List[str]) -> List[str]:
        """The object keys of the pages, in page order (K then V for MHA)."""
        if self.is_mla:
            return [f"{k}_{self.suffix}_k" for k in keys]
        out = []
        for k in keys:
            out += [f"{k}_{self.suffix}_k", f"{k}_{self.suffix}_v"]
        return out

    def _per_page(self) -> int:
        return 1 if self.is_mla else 2

    def _pages(self, ok: List[bool], pages: int) -> List[bool]:
        m = self._per_page()
        return [all(ok[p * m:(p + 1) * m]) for p in range(pages)]

    # ---- the v1 zero-copy interface -------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host):
        self.mem_pool_host = mem_pool_host

    def _page_buffers(self, keys, host_indices):
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        objects = self._objects(keys)
        if len(ptrs) != len(objects) or len(sizes) != len(objects):
            raise ValueError(f"{len(keys)} pages give {len(ptrs)} buffers, expected {len(objects)}")
        return objects, [(int(p), int(s)) for p, s in zip(ptrs, sizes)]

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        found = self.store.batch_exists(self._objects(keys))
        for i, f in enumerate(found):
            if f is not True:
                return i // self._per_page()
        return len(keys)

    def batch_get_v1(self, keys: List[str], host_indices, extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> List[bool]:
        try:
            objects, bufs = self._page_buffers(keys, host_indices)
            results = self.store.batch_get_into(objects, bufs)
        except kvtide.KvtideError:
            return [False] * len(keys)
        ok = [isinstance(r, int) and r == size for r, (_, size) in zip(results, bufs)]
        return self._pages(ok, len(keys))

    def batch_set_v1(self, keys: List[str], host_indices, extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> List[bool]:
        try:
            objects, bufs = self._page_buffers(keys, host_indices)
            results = self.store.batch_put_from(objects, bufs)
        except kvtide.KvtideError:
            return [False] * len(keys)
        # A page already stored (by another rank's identical write, or earlier) counts as stored.
        ok = [r is None or isinstance(r, kvtide.AlreadyExists) for r in results]
        return self._pages(ok, len(keys))

    # ---- the generic interface (one flat tensor per page) ---------------------------------------

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        """Reads page ``key`` into ``target_location`` (a tensor, or an address with
        ``target_sizes``): the target, or None on a miss."""
        if target_location is None:
            return None
        dst = (int(target_location), int(target_sizes)) if isinstance(target_location, int) else target_location
        try:
            self.store.get_into(self._flat(key), dst)
            return target_location
        except kvtide.KvtideError:
            return None

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None):
        if target_locations is None:
            return [None] * len(keys)
        sizes = target_sizes if target_sizes is not None else [None] * len(keys)
        return [self.get(k, t, s) for k, t, s in zip(keys, target_locations, sizes)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        src = value
        if src is None and target_location is not None:
            src = (int(target_location), int(target_sizes)) if isinstance(target_location, int) else target_location
        if src is None:
            return False
        try:
            self.store.put(self._flat(key), src)
            return True
        except kvtide.AlreadyExists:
            return True
        except kvtide.KvtideError:
            return False

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        n = len(keys)
        values = values if values is not None else [None] * n
        locations = target_locations if target_locations is not None else [None] * n
        sizes = target_sizes if target_sizes is not None else [None] * n
        return all(self.set(k, v, t, s) for k, v, t, s in zip(keys, values, locations, sizes))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1 or self.store.exists(self._flat(key))

    def _flat(self, key: str) -> str:
        """The object of a whole flat page (the generic interface)."""
        return f"{key}_{self.suffix}_flat"

    # ---- housekeeping ---------------------------------------------------------------------------

    def clear(self) -> None:
        """Removes this rank's pages (objects being read are skipped)."""
        mine = [k for k in self.store.keys() if k.decode("utf-8", "replace").endswith(
            (f"_{self.suffix}_k", f"_{self.suffix}_v", f"_{self.suffix}_flat"))]
        self.store.batch_remove(mine)

    def get_stats(self):
        return self.store.stats()

    def close(self) -> None:
        self.store.close()
