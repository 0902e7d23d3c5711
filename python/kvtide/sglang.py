"""An SGLang HiCache storage backend on kvtide, for SGLang 0.5.23 (``SUPPORTED_SGLANG``).

Use it as SGLang's dynamic backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvtide", "module_path": "kvtide.sglang", "class_name": "KvtideHiCacheStorage",
        "interface_v1": 1, "kvtide_address": "unix:/run/kvtide/owner.sock"}'

What it owns: the names of SGLang's pages in kvtide and the moves between SGLang's host pools
and kvtide. SGLang's factory builds it as ``KvtideHiCacheStorage(storage_config, kwargs)``; its
cache controller then registers the host KV pool (``register_mem_pool_host``) and, for hybrid
models, the side pools (``register_mem_host_pool_v2``: SWA, Mamba, ...).

- **Where.** ``kvtide_address`` (or ``KVTIDE_ADDRESS``) names a ``kvtide-owner``, with
  ``kvtide_connect`` (a dict of ``kvtide.connect`` keywords); without one each rank opens kvtide
  embedded with ``kvtide_settings`` (``kvtide.Store`` keywords) and the ``KVTIDE_*`` variables.
  An unreachable owner, an unknown or mistyped extra-config key, or a pool it cannot address
  page by page fails the attach with the reason.
- **Names.** One page of one pool is one object, ``sglang/v1/{digest}/{page hash}``. The digest
  (``kvtide._naming.Namespace``) covers everything that fixes what the bytes mean: the model
  (SGLang's model name, plus ``kvtide_cache_tag``; one of them is required), its revision and
  quantization, the pool's class, dtype, layout, tokens per page, head and layer geometry and
  buffer sizes, the parallel layout (tp, pp, attention cp, dcp) and which interface wrote it.
  A reader of any other configuration misses; it never gets other bytes.
- **MLA** pages are the same on every TP rank, so their names leave the TP rank out and one
  object serves all ranks. SGLang's controller lets only the writer rank
  (``HiCacheStorageConfig.is_storage_writer``) back them up; this backend does not second-guess
  it (a second identical write settles as stored). Mamba state stays per rank.
- **Heterogeneous TP** (``tp_lcm_size`` with the ``page_head`` layout): an MHA page is stored as
  one object per rank of the ``tp_lcm_size`` split, ``.../{page hash}/{virtual rank}``, so ranks
  of different TP sizes share the pages of their heads.
- **Zero copy** (``"interface_v1": 1``): pages are read and written in place in the host pool,
  each page gathered from (or scattered to) its buffers in one kvtide batch call per batch
  (``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``), for every host layout.
  Without it SGLang calls the generic interface, which stores SGLang's flat page copy.
- **Results.** ``batch_exists`` counts the leading pages that exist; the v1 and v2 calls answer
  one bool per page and never raise (SGLang's storage threads would log and drop the batch). A
  page read succeeds only when its object fills its buffers exactly; a page write succeeds when
  kvtide stored it, or holds an object of exactly its size under its name.
- ``get_stats`` returns SGLang's ``StorageMetrics`` (pages and GB/s per batch, when
  ``--enable-metrics`` asks for them), never a dict.

It never names a page before SGLang has registered the host pool that fixes its layout (until
then every call misses and nothing is read or written), and never imports a copy of SGLang's
interface: without SGLang, or with another version, importing this module fails and names the
supported version.
"""

import logging
import os
import time
from collections import deque
from typing import Any, Dict, List, Optional, Sequence, Tuple

import kvtide
from kvtide._naming import IdentityError, Namespace, dtype_name, settle_puts

SUPPORTED_SGLANG = "0.5.23"


def _version_supported(version: Optional[str]) -> bool:
    """Exactly ``SUPPORTED_SGLANG``, with or without a local build label (``0.5.23+cu129``)."""
    return isinstance(version, str) and (version == SUPPORTED_SGLANG or version.startswith(SUPPORTED_SGLANG + "+"))


def _require_sglang() -> None:
    try:
        import sglang
    except ImportError as e:
        raise ImportError(
            f"kvtide.sglang is the HiCache storage backend for SGLang {SUPPORTED_SGLANG}, which is not "
            f"installed ({e}); install it with: pip install 'sglang=={SUPPORTED_SGLANG}'") from e
    version = getattr(sglang, "__version__", None)
    if not _version_supported(version):
        raise ImportError(
            f"kvtide.sglang supports SGLang {SUPPORTED_SGLANG} only, but SGLang {version} is installed: its "
            f"HiCache storage interface may differ; install sglang=={SUPPORTED_SGLANG} or a kvtide release for "
            f"SGLang {version}")


_require_sglang()

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.observability.metrics_collector import StorageMetrics  # noqa: E402

import torch  # noqa: E402  (SGLang's own dependency)

__all__ = ["KvtideHiCacheStorage", "ConfigError", "IdentityError", "SUPPORTED_SGLANG"]

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """The backend's extra config, or a host pool SGLang registered, cannot be used."""


# Extra-config keys SGLang itself reads or passes through (its controller pops some before the
# backend sees them); any other key must be one of ours.
_SGLANG_KEYS = {
    "backend_name": str, "module_path": str, "class_name": str, "interface_v1": (bool, int),
    "prefetch_threshold": None, "prefetch_timeout_base": None, "prefetch_timeout_per_ki_token": None,
    "hicache_storage_pass_prefix_keys": None, "tp_lcm_size": None, "file_storage_path": None, "allocator": None,
}
_KVTIDE_KEYS = {"kvtide_address": str, "kvtide_connect": dict, "kvtide_settings": dict, "kvtide_cache_tag": str}

# Host-pool attributes that fix a page's geometry, where a pool has them.
_GEOMETRY = ("layer_num", "target_layer_num", "start_layer", "end_layer", "head_num", "head_dim", "v_head_dim",
             "head_group_num", "kv_lora_rank", "qk_rope_head_dim", "kv_cache_dim", "dsa_kv_cache_store_fp8",
             "num_mamba_layers", "temporal_state_shape", "conv_state_shapes", "temporal_dtype", "conv_dtype")

# Layouts whose flat page (the generic interface) SGLang's host pools can produce.
_FLAT_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")

_METRICS_CAP = 4096


def _validate_extra(extra: Any) -> Dict[str, Any]:
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise ConfigError(f"kvtide.sglang: the storage extra config is a {type(extra).__name__}, expected a dict")
    allowed = {**_SGLANG_KEYS, **_KVTIDE_KEYS}
    for key, value in extra.items():
        if key not in allowed:
            raise ConfigError(f"kvtide.sglang: unknown extra-config key {key!r}; kvtide reads "
                              f"{sorted(_KVTIDE_KEYS)} and passes SGLang's {sorted(_SGLANG_KEYS)}")
        want = allowed[key]
        if want is not None and (not isinstance(value, want) or (want is str and not value)):
            names = " or ".join(t.__name__ for t in (want if isinstance(want, tuple) else (want,)))
            raise ConfigError(f"kvtide.sglang: extra-config key {key!r} is {value!r}, expected a non-empty {names}")
    if extra.get("interface_v1", 0) not in (0, 1):
        raise ConfigError(f"kvtide.sglang: 'interface_v1' is {extra['interface_v1']!r}, expected 0 or 1")
    for key in ("kvtide_connect", "kvtide_settings"):
        if any(not isinstance(k, str) for k in extra.get(key, {})):
            raise ConfigError(f"kvtide.sglang: {key!r} must map keyword names to values")
    if "kvtide_address" in extra and "kvtide_settings" in extra:
        raise ConfigError("kvtide.sglang: give 'kvtide_address' (an owner) or 'kvtide_settings' (embedded), not both")
    return extra


def _open_store(extra: Dict[str, Any]):
    address = extra.get("kvtide_address") or os.environ.get("KVTIDE_ADDRESS")
    if address:
        try:
            return kvtide.connect(address, **extra.get("kvtide_connect", {}))
        except kvtide.KvtideError as e:
            raise type(e)(f"kvtide.sglang: cannot reach the kvtide owner at {address!r}: {e}") from e
        except TypeError as e:
            raise ConfigError(f"kvtide.sglang: bad 'kvtide_connect' for {address!r}: {e}") from e
    if "kvtide_connect" in extra:
        raise ConfigError("kvtide.sglang: 'kvtide_connect' needs 'kvtide_address' (or KVTIDE_ADDRESS)")
    try:
        return kvtide.Store(env=True, **extra.get("kvtide_settings", {}))
    except kvtide.KvtideError as e:
        raise type(e)(f"kvtide.sglang: cannot open kvtide embedded with {extra.get('kvtide_settings', {})}: {e}") from e


def _runtime_model_fields() -> Dict[str, Any]:
    """The served model's revision and quantization, where SGLang has published them (they fix what
    KV bytes mean but are not in HiCacheStorageConfig)."""
    fields: Dict[str, Any] = {}
    try:
        from sglang.srt.runtime_context import get_model

        model = get_model()
    except Exception:  # not published in this process (e.g. a bare test): the fields stay unset
        return {"revision": None, "quantization": None, "kv_cache_dtype": None}
    for name in ("revision", "quantization", "kv_cache_dtype"):
        try:
            value = getattr(model, name)
        except Exception:
            value = None
        fields[name] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
    return fields


def _scalar(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if type(value).__name__ == "dtype":
        return dtype_name(value)
    return str(value)


class _BatchError(Exception):
    """One batch cannot be addressed (a bad index count or buffer table): every page of it fails."""


class _Pool:
    """One registered host pool: its object-name prefix and how its pages map to buffers."""

    __slots__ = ("name", "host", "prefix", "page_size", "split", "ranks", "object_bytes")

    def __init__(self, name, host, prefix: str, page_size: int, object_bytes: int, split: int = 1,
                 first_rank: Optional[int] = None):
        self.name = name
        self.host = host
        self.prefix = prefix
        self.page_size = page_size
        self.split = split  # objects per page: this rank's share of the tp_lcm_size ranks, else 1
        # Under tp_lcm_size each object is named by its rank among the tp_lcm_size ranks.
        self.ranks = None if first_rank is None else [f"/{first_rank + i}" for i in range(split)]
        self.object_bytes = object_bytes

    def objects(self, keys: Sequence[str]) -> List[str]:
        p = self.prefix
        if self.ranks is None:
            return [p + k for k in keys]
        return [p + k + r for k in keys for r in self.ranks]

    def buffers(self, keys: Sequence[str], host_indices) -> Tuple[List[tuple], int]:
        """Per object, its (address, size) buffers in page order; and the bytes of one object."""
        n = len(keys)
        if host_indices.numel() != n * self.page_size:
            raise _BatchError(f"{n} pages need {n * self.page_size} host indices, got {host_indices.numel()}")
        if self.split == 1:
            ptrs, sizes = self.host.get_page_buffer_meta(host_indices)
        else:
            ptrs, sizes = self.host.get_split_heads_page_buffer_meta(host_indices, self.split)
        m = n * self.split
        count = len(ptrs)
        if m == 0 or count != len(sizes) or count % m:
            raise _BatchError(f"{n} pages gave {count} buffers and {len(sizes)} sizes, not a whole number "
                              f"per object ({m} objects)")
        per = count // m
        if type(sizes) is not list:
            sizes = list(sizes)
        first = sizes[:per]
        if sizes != first * m:
            raise _BatchError(f"the objects of {n} pages have different buffer sizes")
        # Groups of `per` consecutive (address, size) pairs, built in C: this runs for every batch.
        pairs = iter(zip(ptrs, sizes))
        return list(zip(*[pairs] * per)), sum(first)


class KvtideHiCacheStorage(HiCacheStorage):
    """HiCache pages in kvtide (see the module docstring for names and results)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None, *, store=None):
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise ConfigError(f"kvtide.sglang: storage_config is a {type(storage_config).__name__}, "
                              "expected SGLang's HiCacheStorageConfig")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ConfigError(f"kvtide.sglang: the factory's kwargs is a {type(kwargs).__name__}, expected a dict")
        extra = _validate_extra(storage_config.extra_config)
        cfg = storage_config
        self.config = cfg
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        self.is_mla = bool(cfg.is_mla_model)
        self.enable_metrics = bool(cfg.enable_storage_metrics)
        # Everything engine-wide that fixes what a page's bytes mean; each pool adds its own.
        self._identity = {
            "model": cfg.model_name or None,
            "cache_tag": extra.get("kvtide_cache_tag"),
            **_runtime_model_fields(),
            "mla": self.is_mla,
            "pp_size": cfg.pp_size, "pp_rank": cfg.pp_rank,
            "attn_cp_size": cfg.attn_cp_size, "attn_cp_rank": cfg.attn_cp_rank,
            "dcp_size": getattr(cfg, "dcp_size", 1), "dcp_rank": getattr(cfg, "dcp_rank", 0),
            "logical_page_size": getattr(cfg, "logical_page_size", None),
            "interface": "v1" if self.interface_v1 else "flat",
        }
        Namespace("sglang", self._identity)  # refuses now, before any I/O, without a model identity
        self.store = store if store is not None else _open_store(extra)
        self._owns_store = store is None
        self.mem_pool_host = None
        self.registered_pools: Dict[Any, Any] = {}
        self._kv: Optional[_Pool] = None
        self._pools: Dict[Any, _Pool] = {}
        self.namespaces: Dict[str, Namespace] = {}
        self._prefetch_pgs: deque = deque(maxlen=_METRICS_CAP)
        self._backup_pgs: deque = deque(maxlen=_METRICS_CAP)
        self._prefetch_bw: deque = deque(maxlen=_METRICS_CAP)
        self._backup_bw: deque = deque(maxlen=_METRICS_CAP)
        self.metrics_dropped = 0  # metric samples dropped because nobody drained them

    # ---- registration (the namespace is final once the pool is known) ---------------------------

    def _pool_identity(self, name, host, split: int) -> Dict[str, Any]:
        cfg = self.config
        ident = dict(self._identity)
        ident.update(pool=str(name), pool_class=type(host).__name__, layout=getattr(host, "layout", None),
                     page_size=getattr(host, "page_size", None), dtype=dtype_name(getattr(host, "dtype", None)),
                     storage_format_tag=getattr(host, "storage_format_tag", None))
        for attr in _GEOMETRY:
            if hasattr(host, attr):
                ident[attr] = _scalar(getattr(host, attr))
        replicated = self.is_mla and name != PoolName.MAMBA and not _is_mha_pool(host)
        if replicated:
            ident["tp"] = "replicated"
        elif split:
            # Names carry the rank of the tp_lcm_size split; a page object holds head_num / split heads.
            ident.update(tp_lcm_size=cfg.tp_lcm_size, head_num=ident.get("head_num", 0) // split)
        else:
            ident.update(tp_size=cfg.tp_size, tp_rank=cfg.tp_rank)
        if not split:
            try:
                ident["size_per_token"] = int(host.get_size_per_token())
            except Exception:
                pass
        return ident

    def _make_pool(self, name, host, *, flat: bool) -> _Pool:
        what = f"the {name} host pool ({type(host).__name__}, layout {getattr(host, 'layout', None)!r})"
        if getattr(host, "kv_buffer", "absent") is None:
            raise ConfigError(f"kvtide.sglang: {what} has no host buffer (a logical anchor); not supported")
        page_size = int(getattr(host, "logical_page_size", None) or getattr(host, "page_size", 0) or 0)
        if page_size <= 0:
            raise ConfigError(f"kvtide.sglang: {what} has no page size")
        cfg = self.config
        split = 0
        if (not flat and not self.is_mla and cfg.tp_lcm_size and _is_mha_pool(host)
                and (cfg.should_split_heads or cfg.tp_lcm_size == cfg.tp_size)):
            split = cfg.tp_lcm_size // cfg.tp_size
            if split * cfg.tp_size != cfg.tp_lcm_size or host.head_num % split:
                raise ConfigError(f"kvtide.sglang: tp_lcm_size {cfg.tp_lcm_size} does not split tp_size "
                                  f"{cfg.tp_size} with {host.head_num} heads into whole ranks")
        ident = self._pool_identity(name, host, split)
        if flat:
            if getattr(host, "layout", None) not in _FLAT_LAYOUTS:
                raise ConfigError(f"kvtide.sglang: {what}: the generic interface cannot copy this layout; "
                                  "set \"interface_v1\": 1")
            object_bytes = int(host.get_size_per_token()) * page_size
            ident["flat_page_bytes"] = object_bytes
        else:
            probe = _Pool(name, host, "", page_size, 0, max(split, 1))
            try:
                bufs, object_bytes = probe.buffers(["p"], torch.arange(page_size, dtype=torch.int64))
            except Exception as e:
                raise ConfigError(f"kvtide.sglang: {what} cannot be addressed page by page: {e}") from e
            ident["object_buffers"] = ",".join(str(s) for _, s in bufs[0])
            if object_bytes <= 0:
                raise ConfigError(f"kvtide.sglang: {what} has empty pages")
        ns = Namespace("sglang", ident)
        self.namespaces[str(name)] = ns
        first_rank = cfg.tp_rank * split if split else None
        return _Pool(name, host, ns.prefix + "/", page_size, object_bytes, max(split, 1), first_rank)

    def register_mem_pool_host(self, mem_pool_host):
        self._kv = self._make_pool(PoolName.KV, mem_pool_host, flat=not self.interface_v1)
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        if host_pool_name == PoolName.KV and host_pool is self.mem_pool_host:
            return  # the anchor, registered by register_mem_pool_host
        self._pools[host_pool_name] = self._make_pool(host_pool_name, host_pool, flat=False)
        self.registered_pools[host_pool_name] = host_pool

    def on_host_pools_registered(self) -> None:
        if self._kv is None:
            raise ConfigError("kvtide.sglang: SGLang attached the backend without registering its host KV pool")

    def _pool(self, name) -> Optional[_Pool]:
        if name == PoolName.KV and name not in self._pools:
            # The KV pool through v2 moves page buffers, which only the v1 namespace holds.
            return self._kv if self.interface_v1 else None
        return self._pools.get(name)

    # ---- metrics ---------------------------------------------------------------------------------

    def _record(self, pgs: deque, bw: deque, pages: int, nbytes: int, seconds: float) -> None:
        if pages <= 0:
            return
        if len(pgs) == pgs.maxlen:
            self.metrics_dropped += 1
        pgs.append(pages)
        if seconds > 0:
            bw.append(nbytes / seconds / 1e9)

    def get_stats(self):
        metrics = StorageMetrics()
        for source, target in ((self._prefetch_pgs, metrics.prefetch_pgs), (self._backup_pgs, metrics.backup_pgs),
                               (self._prefetch_bw, metrics.prefetch_bandwidth),
                               (self._backup_bw, metrics.backup_bandwidth)):
            while True:
                try:
                    target.append(source.popleft())
                except IndexError:
                    break
        return metrics

    # ---- existence -------------------------------------------------------------------------------

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        kv = self._kv
        if kv is None or not keys:
            return 0
        try:
            return self.store.prefix_hits(kv.objects(keys)) // kv.split
        except Exception as e:
            logger.warning("kvtide.sglang: batch_exists of %d pages failed: %s", len(keys), e)
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---- the zero-copy interface (v1) ------------------------------------------------------------

    def _get_pages(self, pool: _Pool, keys, host_indices) -> Tuple[List[bool], int]:
        bufs, size = pool.buffers(keys, host_indices)
        results = self.store.batch_get_into_multi_buffers(pool.objects(keys), bufs)
        ok = [r == size for r in results]  # a length, or the exception in its place
        return _per_page(ok, pool.split), size

    def _set_pages(self, pool: _Pool, keys, host_indices) -> Tuple[List[bool], int]:
        bufs, size = pool.buffers(keys, host_indices)
        names = pool.objects(keys)
        results = self.store.batch_put_from_multi_buffers(names, bufs)
        if results.count(None) == len(results):
            ok = [True] * len(results)
        else:
            ok = settle_puts(self.store, names, [size] * len(names), results)
        return _per_page(ok, pool.split), size

    def batch_get_v1(self, keys: List[str], host_indices, extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> List[bool]:
        if self._kv is None or not self.interface_v1:
            return [False] * len(keys)
        start = time.perf_counter() if self.enable_metrics else 0.0
        try:
            ok, size = self._get_pages(self._kv, keys, host_indices)
        except Exception as e:
            logger.warning("kvtide.sglang: batch_get_v1 of %d pages failed: %s", len(keys), e)
            return [False] * len(keys)
        if self.enable_metrics:
            pages = ok.count(True)
            self._record(self._prefetch_pgs, self._prefetch_bw, pages, pages * size * self._kv.split,
                         time.perf_counter() - start)
        return ok

    def batch_set_v1(self, keys: List[str], host_indices, extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> List[bool]:
        if self._kv is None or not self.interface_v1:
            return [False] * len(keys)
        start = time.perf_counter() if self.enable_metrics else 0.0
        try:
            ok, size = self._set_pages(self._kv, keys, host_indices)
        except Exception as e:
            logger.warning("kvtide.sglang: batch_set_v1 of %d pages failed: %s", len(keys), e)
            return [False] * len(keys)
        if self.enable_metrics:
            pages = ok.count(True)
            self._record(self._backup_pgs, self._backup_bw, pages, pages * size * self._kv.split,
                         time.perf_counter() - start)
        return ok

    # ---- hybrid pools (v2) -----------------------------------------------------------------------

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        kv_pages = self.batch_exists(keys, extra_info)
        hits: Dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        if not restorable:
            return PoolTransferResult(0, hits, [])
        transfers = list(pool_transfers or [])
        try:
            pools = [self._pool(t.name) for t in transfers]
            spans, names = [], []
            for t, pool in zip(transfers, pools):
                start = len(names)
                if pool is not None:
                    names += pool.objects(keys[:kv_pages])
                spans.append((start, len(names)))
            found = self.store.batch_exists(names) if names else []
        except Exception as e:
            logger.warning("kvtide.sglang: batch_exists_v2 of %d pages failed: %s", len(keys), e)
            return PoolTransferResult(0, {}, [])
        for t, pool, (a, b) in zip(transfers, pools, spans):
            if not restorable:
                break
            if pool is None:
                logger.warning("kvtide.sglang: pool %s was never registered; its pages miss", t.name)
                page_exists = [False] * kv_pages
            else:
                m = pool.split
                page_exists = [all(f is True for f in found[a + i * m:a + (i + 1) * m]) for i in range(kv_pages)]
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = page_exists.index(False) if False in page_exists else kv_pages
                pool_restorable = set(range(1, boundary + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                # A stop point works when the window of pages ending there is complete.
                window = max(1, len(t.keys) if t.keys else 1)
                pool_restorable = {n for n in range(1, kv_pages + 1)
                                   if all(page_exists[max(0, n - window):n])}
                boundary = max(pool_restorable, default=0)
            else:
                logger.warning("kvtide.sglang: hit policy %s of pool %s is not supported; its pages miss",
                               t.hit_policy, t.name)
                pool_restorable, boundary = set(), 0
            if boundary:
                hits[t.name] = boundary
            restorable = [n for n in restorable if n in pool_restorable]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def _batch_io_v2(self, transfers: List[PoolTransfer], write: bool) -> Dict[Any, List[bool]]:
        results: Dict[Any, List[bool]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            pool = self._pool(t.name)
            if pool is None:
                logger.warning("kvtide.sglang: pool %s was never registered", t.name)
                results[t.name] = [False] * len(keys)
                continue
            if not keys:
                results[t.name] = []
                continue
            try:
                if t.host_indices is None:
                    raise _BatchError("no host indices")
                ok, _ = (self._set_pages if write else self._get_pages)(pool, keys, t.host_indices)
            except Exception as e:
                logger.warning("kvtide.sglang: batch_%s_v2 of %d %s pages failed: %s", "set" if write else "get",
                               len(keys), t.name, e)
                ok = [False] * len(keys)
            results[t.name] = ok
        return results

    def batch_get_v2(self, transfers: List[PoolTransfer], extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> Dict[Any, List[bool]]:
        return self._batch_io_v2(transfers, write=False)

    def batch_set_v2(self, transfers: List[PoolTransfer], extra_info: Optional[HiCacheStorageExtraInfo] = None
                     ) -> Dict[Any, List[bool]]:
        return self._batch_io_v2(transfers, write=True)

    # ---- the generic interface (one flat page copy per key) --------------------------------------

    def _flat_pool(self) -> Optional[_Pool]:
        return self._kv if self._kv is not None and not self.interface_v1 else None

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        """Reads page ``key`` into ``target_location`` (a tensor, or an address with ``target_sizes``):
        the target, or None on a miss or when the object does not fill it exactly."""
        return self.batch_get([key], [target_location], None if target_sizes is None else [target_sizes])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None):
        pool = self._flat_pool()
        if pool is None or target_locations is None or len(target_locations) != len(keys):
            return [None] * len(keys)
        start = time.perf_counter()
        try:
            dsts, sizes = _flat_buffers(target_locations, target_sizes)
            got = self.store.batch_get_into_multi_buffers(pool.objects(keys), [[d] for d in dsts])
        except Exception as e:
            logger.warning("kvtide.sglang: batch_get of %d pages failed: %s", len(keys), e)
            return [None] * len(keys)
        out = [t if (type(r) is int and r == s == pool.object_bytes) else None
               for t, r, s in zip(target_locations, got, sizes)]
        if self.enable_metrics:
            done = len(out) - out.count(None)
            self._record(self._prefetch_pgs, self._prefetch_bw, done, done * pool.object_bytes,
                         time.perf_counter() - start)
        return out

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], None if value is None else [value],
                              None if target_location is None else [target_location],
                              None if target_sizes is None else [target_sizes])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """True when every page is stored (see the module docstring)."""
        pool = self._flat_pool()
        sources = values if values is not None else target_locations
        if pool is None or not keys or sources is None or len(sources) != len(keys):
            return False
        start = time.perf_counter()
        try:
            srcs, sizes = _flat_buffers(sources, None if values is not None else target_sizes)
            if any(s != pool.object_bytes for s in sizes):
                return False  # not a whole page of this pool
            names = pool.objects(keys)
            results = self.store.batch_put_from(names, srcs)
            ok = settle_puts(self.store, names, sizes, results)
        except Exception as e:
            logger.warning("kvtide.sglang: batch_set of %d pages failed: %s", len(keys), e)
            return False
        if self.enable_metrics:
            written = results.count(None)
            self._record(self._backup_pgs, self._backup_bw, written, written * pool.object_bytes,
                         time.perf_counter() - start)
        return all(ok)

    # ---- housekeeping ----------------------------------------------------------------------------

    def clear(self) -> None:
        """Removes the objects of this backend's namespaces (objects being read are skipped). Under
        MLA that includes the pages every TP rank shares."""
        for ns in list(self.namespaces.values()):
            try:
                names = self.store.keys(ns.prefix + "/")
                if names:
                    self.store.batch_remove(names)
            except kvtide.KvtideError as e:
                logger.warning("kvtide.sglang: clearing %s failed: %s", ns.prefix, e)

    def close(self) -> None:
        if self._owns_store:
            self.store.close()


def _is_mha_pool(host) -> bool:
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    return isinstance(host, MHATokenToKVPoolHost)


def _per_page(ok: List[bool], m: int) -> List[bool]:
    if m == 1:
        return ok
    return [all(ok[i:i + m]) for i in range(0, len(ok), m)]


def _flat_buffers(targets, sizes) -> Tuple[list, List[int]]:
    """The generic interface's page buffers: tensors (their byte size), or addresses with sizes."""
    bufs, nbytes = [], []
    for i, t in enumerate(targets):
        if isinstance(t, int) and not isinstance(t, bool):
            size = int(sizes[i]) if sizes is not None else -1
            bufs.append((t, size))
            nbytes.append(size)
        elif hasattr(t, "element_size") and hasattr(t, "numel"):
            bufs.append(t)
            nbytes.append(int(t.numel()) * int(t.element_size()))
        else:
            view = memoryview(t)
            bufs.append(t)
            nbytes.append(view.nbytes)
    return bufs, nbytes
