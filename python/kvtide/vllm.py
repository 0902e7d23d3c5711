"""kvtide as a vLLM KV offloading spec (``vllm.v1.kv_offload``, vLLM 0.34.0 only).

vLLM's own ``OffloadingConnector`` loads it by name::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KvtideOffloadingSpec",
        "spec_module_path": "kvtide.vllm", "kvtide_address": "unix:/run/kvtide/owner.sock"}}'

Owns the spec (configuration checks, object names), the scheduler-side manager (lookups,
holds, store bookkeeping, KV events) and the worker (stores and loads of device blocks). Never
decides what vLLM caches or evicts (vLLM's scheduler and kvtide's engine do), never copies
vLLM's interface (it subclasses vLLM's own classes, and refuses to load beside any vLLM but
``SUPPORTED_VLLM``), and never reports a load or store that did not complete byte for byte as a
success.

Objects. One offloaded chunk (vLLM's ``OffloadKey``: a block hash and its KV cache group) of one
worker rank is one object, named ``vllm/v{LAYOUT_VERSION}/{digest}/{key hex}``. The digest
(``kvtide._naming.Namespace``) covers everything that fixes what the bytes mean: the model name
and revision (or the user's ``kvtide_cache_tag`` instead), the KV cache dtype resolved against
the model dtype, the model dtype, quantization, KV heads and head size, the TP/PP/PCP/DCP sizes
and this rank's TP/PP/PCP coordinates, tokens per hash and per block, blocks per chunk, the KV
cache groups (layers, window), the worker's KV bytes per block, the KV cache layout and this
module's object layout. A reader of any other configuration misses: it never gets other bytes.
With vLLM's ``replicated_layout`` (pure MLA, TP only) every TP rank holds the same bytes, so the
chunk is stored once (by rank 0) under a name without the TP rank. An object holds a chunk's
blocks data ref after data ref: ref ``d``'s block ``b`` at ``blocks_per_chunk * sum(sizes of
refs before d) + b * size of ref d``.

Lookups. vLLM asks per chunk and per request. The first lookup of a chunk answers ``RETRY`` and
queues the chunk; at the end of the step (``on_schedule_end``) every queued chunk of every
request goes to a background thread as ONE ``Store.hold`` (one round trip, or a few for
batches past the owner's item limit), which leases every rank's object of each chunk. The next
step's lookups answer from that result: a chunk is a ``HIT`` only when every rank's object is
held. The hold keeps the objects in place until vLLM's ``complete_load`` (or the request ends,
or ``kvtide_hold_ttl_ms`` passes), so an eviction between lookup and load cannot fail the load.
Stores without holds (cluster stores) fall back to one ``batch_exists``; then a chunk evicted
before its load fails that load, which is reported, never hidden.

Stores are whole chunks only; an object that already exists counts as stored only when its
size is the size this worker would have written (``settle_puts``). Loads check every object's
size before they report success.
"""

import logging
import os
import queue
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import kvtide
from kvtide._naming import Namespace, dtype_name, settle_puts

SUPPORTED_VLLM = "0.34.0"

try:
    import vllm as _vllm
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"kvtide.vllm needs vLLM {SUPPORTED_VLLM} (pip install vllm=={SUPPORTED_VLLM}); vLLM is not importable: {_e}"
    ) from _e

_found = str(getattr(_vllm, "__version__", "unknown"))
if _found.split("+", 1)[0] != SUPPORTED_VLLM:
    raise ImportError(
        f"kvtide.vllm supports vLLM {SUPPORTED_VLLM} only, found vLLM {_found}: its KV offloading interface "
        f"changes between releases (install vllm=={SUPPORTED_VLLM})"
    )

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: E402
    OffloadingConnector,
)
from vllm.v1.kv_offload.base import (  # noqa: E402
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    PrepareStoreOutput,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.pointer_utils import iter_pointer_groups  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

__all__ = [
    "SUPPORTED_VLLM",
    "ConfigError",
    "KvtideOffloadingSpec",
    "KvtideOffloadingManager",
    "KvtideOffloadingWorker",
    "KvtideLoadStoreSpec",
]

logger = logging.getLogger(__name__)

# Bumped when this module lays a chunk out differently (it is part of every object name).
OBJECT_LAYOUT = "chunk/ref-major/v1"
# vLLM's own keys of kv_connector_extra_config for an OffloadingConnector, which this spec
# accepts beside its own; anything else is a typo and is refused.
_VLLM_KEYS = frozenset({
    "spec_name", "spec_module_path", "blocks_per_chunk", "block_size", "offload_prompt_only",
    "self_describing_kv_events", "sync_load_budget_bytes", "canonical_layout",
})
_KVTIDE_KEYS = {
    "kvtide_address": "owner address: unix:/path/owner.sock or host:port (default $KVTIDE_ADDRESS)",
    "kvtide_connect": "dict of kvtide.connect keywords (token_file, timeout_ms, ...)",
    "kvtide_settings": "dict of kvtide.Store keywords for an embedded store (no owner)",
    "kvtide_cache_tag": "string naming the model's KV instead of the model name and revision",
    "kvtide_hold_ttl_ms": "how long a lookup's hold keeps chunks in place (1000..3600000, default 30000)",
    "kvtide_threads": "worker transfer threads (1..64, default 4)",
    "kvtide_require_hold": "refuse stores that cannot hold chunks (cluster stores) (default false)",
}
# A HIT is answered only this long before its hold ends; later the chunk is looked up again.
_HOLD_MARGIN_S = 2.0
# Chunks announced stored whose removal this manager would still announce; past it the oldest
# are announced removed (no longer vouched for), so neither side's tables grow without bound.
_MAX_ANNOUNCED = 1 << 16


class ConfigError(ValueError):
    """The vLLM configuration or the kvtide extra config cannot be served safely."""


# ---- configuration -----------------------------------------------------------------------------


class _Settings:
    """The kvtide_* keys of kv_connector_extra_config, checked."""

    def __init__(self, extra):
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if k not in _VLLM_KEYS and k not in _KVTIDE_KEYS)
        if unknown:
            known = ", ".join(sorted(_KVTIDE_KEYS))
            raise ConfigError(f"kvtide.vllm: unknown kv_connector_extra_config keys {unknown}; kvtide's keys are "
                              f"{known} (and vLLM's {sorted(_VLLM_KEYS)})")
        self.address = extra.get("kvtide_address")
        if self.address is None and "kvtide_settings" not in extra:
            self.address = os.environ.get("KVTIDE_ADDRESS") or None
        if self.address is not None and (not isinstance(self.address, str) or not self.address.strip()):
            raise ConfigError(f"kvtide.vllm: kvtide_address must be a non-empty string, got {self.address!r}")
        self.connect = _dict_of(extra, "kvtide_connect")
        self.settings = _dict_of(extra, "kvtide_settings")
        if self.address is not None and "kvtide_settings" in extra:
            raise ConfigError("kvtide.vllm: give kvtide_address (an owner) or kvtide_settings (embedded), not both")
        if self.address is None and "kvtide_connect" in extra:
            raise ConfigError("kvtide.vllm: kvtide_connect needs kvtide_address")
        self.cache_tag = extra.get("kvtide_cache_tag")
        if self.cache_tag is not None and (not isinstance(self.cache_tag, str) or not self.cache_tag.strip()):
            raise ConfigError(f"kvtide.vllm: kvtide_cache_tag must be a non-empty string, got {self.cache_tag!r}")
        self.hold_ttl_ms = _int_in(extra, "kvtide_hold_ttl_ms", 30_000, 1_000, 3_600_000)
        self.threads = _int_in(extra, "kvtide_threads", 4, 1, 64)
        self.require_hold = extra.get("kvtide_require_hold", False)
        if not isinstance(self.require_hold, bool):
            raise ConfigError(f"kvtide.vllm: kvtide_require_hold must be true or false, got {self.require_hold!r}")


def _dict_of(extra, name):
    value = extra.get(name, {})
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"kvtide.vllm: {name} must be a dict with string keys, got {value!r}")
    return dict(value)


def _int_in(extra, name, default, lo, hi):
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"kvtide.vllm: {name} must be an integer from {lo} to {hi}, got {value!r}")
    return value


def _calling_vllm_config():
    """The VllmConfig of the OffloadingConnector being built, if this spec is built by one.

    vLLM hands a spec only the normalized OffloadingConfig, which lacks the model revision,
    quantization and head layout; the connector that builds the spec has them. Both roles build
    their spec through it, so the scheduler and the workers name objects alike."""
    code = OffloadingConnector.__init__.__code__
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return None
        if frame.f_code is code:
            return frame.f_locals.get("vllm_config")
        frame = frame.f_back
    return None


def _identity(config, settings, vllm_config, rank, replicated):
    """Every field that fixes what one rank's chunk bytes mean (see the module docstring)."""
    p = config.parallel
    tp, pp, pcp, dcp = p.tp_size, p.pp_size, p.pcp_size, p.dcp_size
    if min(tp, pp, pcp, dcp) < 1 or p.world_size != tp * pp * pcp:
        raise ConfigError(f"kvtide.vllm: unsupported parallel layout: world size {p.world_size} is not "
                          f"TP {tp} x PP {pp} x PCP {pcp}")
    if not 0 <= rank < p.world_size:
        raise ConfigError(f"kvtide.vllm: rank {rank} outside world size {p.world_size}")
    # vLLM lays ranks out as PP x PCP x TP (TP fastest); DCP shards within TP x PCP, so the TP
    # and PCP coordinates with the DCP size fix this rank's share.
    tp_rank, pcp_rank, pp_rank = rank % tp, (rank // tp) % pcp, rank // (tp * pcp)
    groups = ";".join(
        f"{g.group_id}:{g.tokens_per_block}:{g.sliding_window_size_in_chunks}:{','.join(g.layer_names)}"
        for g in config.groups
    )
    ident = {
        "model": None if settings.cache_tag else config.model.name,
        "cache_tag": settings.cache_tag,
        "kv_dtype": config.model.dtype,
        "tp": tp, "pp": pp, "pcp": pcp, "dcp": dcp,
        "tp_rank": None if replicated else tp_rank, "pcp_rank": pcp_rank, "pp_rank": pp_rank,
        "replicated": replicated,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": groups,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "kv_cache_layout": config.kv_cache_layout,
        "object_layout": OBJECT_LAYOUT,
    }
    if vllm_config is not None:
        mc = vllm_config.model_config
        ident.update({
            "revision": None if settings.cache_tag else mc.revision,
            "model_dtype": dtype_name(mc.dtype),
            "quantization": None if mc.quantization is None else str(mc.quantization),
            "kv_heads": mc.get_total_num_kv_heads(),
            "head_size": mc.get_head_size(),
            "use_mla": bool(mc.use_mla),
            "cp_interleave": vllm_config.parallel_config.cp_kv_cache_interleave_size,
        })
    return ident


# ---- stores --------------------------------------------------------------------------------------


class _Stores:
    """Stores shared by the specs of one process (vLLM's scheduler and an in-process worker open
    the same one), counted, closed when the last user lets go."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open = {}

    @staticmethod
    def _key(settings):
        if settings.address is not None:
            return ("owner", settings.address, tuple(sorted((k, repr(v)) for k, v in settings.connect.items())))
        return ("embedded", tuple(sorted((k, repr(v)) for k, v in settings.settings.items())))

    def acquire(self, settings):
        key = self._key(settings)
        with self._lock:
            entry = self._open.get(key)
            if entry is None:
                entry = [self._connect(settings), 0]
                self._open[key] = entry
            entry[1] += 1
            return key, entry[0]

    def release(self, key):
        with self._lock:
            entry = self._open.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._open[key]
                entry[0].close()

    @staticmethod
    def _connect(settings):
        if settings.address is not None:
            try:
                return kvtide.connect(settings.address, **settings.connect)
            except TypeError as e:
                raise ConfigError(f"kvtide.vllm: bad kvtide_connect keywords {sorted(settings.connect)}: {e}") from e
            except kvtide.KvtideError as e:
                raise ConnectionError(f"kvtide.vllm: cannot reach the kvtide owner at {settings.address!r}: {e}") from e
        try:
            return kvtide.Store(env=True, **settings.settings)
        except (TypeError, kvtide.KvtideError) as e:
            raise ConfigError(f"kvtide.vllm: cannot open an embedded kvtide store with kvtide_settings "
                              f"{settings.settings}: {e}") from e


_STORES = _Stores()


def _holds_supported(store):
    """Whether `store` can hold objects (an embedded store, or an owner over its Unix socket)."""
    try:
        store.hold([], 1_000).release()
        return True
    except kvtide.InvalidArgument:
        return False


# ---- the spec ------------------------------------------------------------------------------------


class KvtideLoadStoreSpec(LoadStoreSpec):
    """The chunks a transfer reads or writes, by vLLM key, in the order of the device blocks."""

    def __init__(self, keys):
        self.keys = list(keys)

    def __repr__(self):
        return f"KvtideLoadStoreSpec({len(self.keys)} keys)"


class KvtideOffloadingSpec(OffloadingSpec):
    """The spec vLLM's ``OffloadingConnector`` builds from ``kv_connector_extra_config``
    (``spec_name: KvtideOffloadingSpec``, ``spec_module_path: kvtide.vllm``). Checks the
    configuration, opens (or shares) the store and names objects here, so bad input fails at
    startup, not at the first step."""

    def __init__(self, config):
        super().__init__(config)
        settings = _Settings(self.extra_config)
        if config.canonical_layout:
            raise ConfigError("kvtide.vllm: canonical_layout is not supported (kvtide stores each rank's pages "
                              "as vLLM lays them out); remove it from kv_connector_extra_config")
        if config.worker_kv_bytes_per_block <= 0:
            raise ConfigError("kvtide.vllm: the KV cache has no bytes per block to offload (a HiSparse host pool "
                              "or an empty cache is not supported)")
        self.settings = settings
        self.replicated_layout = bool(config.replicated_layout)
        vllm_config = _calling_vllm_config()
        if vllm_config is None and not settings.cache_tag:
            # Without the VllmConfig the names would miss revision, quantization and head layout:
            # two such models could share names. A cache tag the user gives names them instead.
            raise ConfigError("kvtide.vllm: spec built outside vLLM's OffloadingConnector, so the model's "
                              "revision, quantization and head layout are unknown; set 'kvtide_cache_tag' "
                              "in kv_connector_extra_config to name what the stored bytes mean")
        ranks = range(config.parallel.world_size)
        self.namespaces = {}
        for r in ranks:
            ns = Namespace("vllm", _identity(config, settings, vllm_config, r, self.replicated_layout))
            self.namespaces.setdefault(ns.prefix, ns)
        self.namespace = Namespace(
            "vllm", _identity(config, settings, vllm_config, config.parallel.rank, self.replicated_layout))
        self._store_key, self.store = _STORES.acquire(settings)
        # The spec's reference passes to its first user (manager or worker); the store is let go
        # when the last user shuts down.
        self._users = 1
        self._handed_over = False
        self.holds = _holds_supported(self.store)
        if not self.holds:
            if settings.require_hold:
                self.close()
                raise ConfigError("kvtide.vllm: kvtide_require_hold is set but this store cannot hold chunks "
                                  "(holds need an embedded store or a kvtide-owner; a cluster store has none)")
            logger.warning("kvtide.vllm: this store cannot hold chunks (a cluster store): a chunk evicted between "
                           "lookup and load fails that load (reported, and recomputed by vLLM)")

    def _use(self):
        if self._handed_over:
            self._users += 1
        self._handed_over = True

    def close(self):
        """Lets go of the store (the last of the spec, its manager and its worker closes it)."""
        self._users -= 1
        if self._users == 0 and self.store is not None:
            _STORES.release(self._store_key)
            self.store = None

    def get_manager(self):
        self._use()
        return KvtideOffloadingManager(self)

    def get_worker(self, kv_caches):
        worker = KvtideOffloadingWorker(self, kv_caches)
        self._use()
        return worker


# ---- the scheduler side ----------------------------------------------------------------------------


class _Share:
    """One background hold, shared by every request whose lookups it answered: a leased object
    is released once no request references it."""

    __slots__ = ("hold", "refs")

    def __init__(self, hold, names):
        self.hold = hold
        self.refs = dict.fromkeys(names, 0)

    def acquire(self, names):
        for n in names:
            self.refs[n] += 1

    def release(self, names):
        drop = []
        for n in names:
            self.refs[n] -= 1
            if self.refs[n] == 0:
                drop.append(n)
        if drop:
            self.hold.release(drop)

    def release_unreferenced(self):
        drop = [n for n, c in self.refs.items() if c == 0]
        if drop:
            self.hold.release(drop)


class _Req:
    """What the manager knows of one request."""

    __slots__ = ("verdicts", "pending", "held", "loading", "finished")

    def __init__(self):
        self.verdicts = {}  # key -> (hit, deadline)
        self.pending = set()  # keys queued or in flight
        self.held = {}  # key -> (share, names) this request references
        self.loading = set()  # keys of a prepared load not completed yet
        self.finished = False


class KvtideOffloadingManager(OffloadingManager):
    """Scheduler side: batched, held lookups (see the module docstring), stores of what is not
    known present, and KV events. Entered by vLLM's scheduler thread only; its background
    thread talks to it through queues, so vLLM's no-op lock suffices."""

    def __init__(self, spec):
        self._spec = spec
        self._store = spec.store
        self._holds = spec.holds
        self._ttl_ms = spec.settings.hold_ttl_ms
        self._margin_s = min(_HOLD_MARGIN_S, self._ttl_ms / 4000)
        self._rank_prefixes = [ns.prefix for ns in spec.namespaces.values()]
        self._events_on = spec.kv_events_config.enable_kv_cache_events
        self._locality = Locality.REMOTE if (self._store.is_remote and not self._holds) else Locality.LOCAL
        self._reqs = {}
        self._batch = []  # (req_id, key) queued this step
        self._in_flight = 0
        self._drain_due = False  # answers may have arrived since the last step end
        self._generation = 0  # bumped by reset_cache: older answers are dropped
        self._storing = {}  # key -> stores prepared and not completed
        self._events = []
        self._announced = OrderedDict()
        self.round_trips = 0  # store calls made for lookups (read by tests and benchmarks)
        self._jobs = queue.SimpleQueue()
        self._results = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._lookup_loop, name="kvtide-vllm-lookup", daemon=True)
        self._thread.start()

    def _names(self, key):
        h = bytes(key).hex()
        return [f"{p}/{h}" for p in self._rank_prefixes]

    # -- the background lookups ------------------------------------------------------------------

    def _lookup_loop(self):
        while True:
            job = self._jobs.get()
            if job is None:
                return
            generation, entries = job
            # Per entry: its rank objects (computed here, off the scheduler thread).
            per_entry = [(req_id, key, self._names(key)) for req_id, key in entries]
            names = list(dict.fromkeys(n for _, _, ns in per_entry for n in ns))
            hold = None
            try:
                if self._holds:
                    hold = self._store.hold(names, self._ttl_ms)
                    found = [isinstance(r, int) and not isinstance(r, bool) for r in hold.results]
                    deadline = time.monotonic() + hold.expires_in_ms / 1000 - self._margin_s
                else:
                    found = [r is True for r in self._store.batch_exists(names)]
                    deadline = time.monotonic() + self._ttl_ms / 1000
            except Exception as e:  # a failed lookup is a miss, never an error of the step
                logger.warning("kvtide.vllm: lookup of %d objects failed: %s", len(names), e)
                found = [False] * len(names)
                deadline = time.monotonic() + self._margin_s
            self.round_trips += 1
            present = dict(zip(names, found))
            answers = [(req_id, key, ns, all(present[n] for n in ns)) for req_id, key, ns in per_entry]
            self._results.put((generation, answers, names, hold, deadline))

    def _drain(self):
        while True:
            try:
                generation, answers, names, hold, deadline = self._results.get_nowait()
            except queue.Empty:
                return
            self._in_flight -= 1
            share = _Share(hold, names) if hold is not None else None
            if generation == self._generation:
                for req_id, key, ns, hit in answers:
                    st = self._reqs.get(req_id)
                    if st is None or st.finished:
                        continue
                    st.pending.discard(key)
                    st.verdicts[key] = (hit, deadline)
                    if hit and share is not None:
                        st.held[key] = (share, ns)
                        share.acquire(ns)
                    if not hit and key in self._announced:
                        self._announce_removed([key])
            if share is not None:
                share.release_unreferenced()

    def _release(self, st, keys):
        by_share = {}
        for key in keys:
            entry = st.held.pop(key, None)
            if entry is not None:
                by_share.setdefault(id(entry[0]), (entry[0], []))[1].extend(entry[1])
        for share, names in by_share.values():
            share.release(names)

    def _forget(self, st, keys):
        """Drops what the request knew of `keys` (a later lookup asks the store again)."""
        keys = [k for k in keys if k not in st.loading]
        self._release(st, keys)
        for k in keys:
            st.verdicts.pop(k, None)

    # -- OffloadingManager -------------------------------------------------------------------------

    def on_new_request(self, req_context):
        self._reqs.setdefault(req_context.req_id, _Req())
        return RequestOffloadingContext()

    def lookup(self, key, req_context):
        if self._drain_due:  # once per step: a queue poll per chunk would cost more than the answer
            self._drain_due = False
            self._drain()
        st = self._reqs.get(req_context.req_id)
        if st is None:
            st = self._reqs[req_context.req_id] = _Req()
        verdict = st.verdicts.get(key)
        if verdict is not None:
            hit, deadline = verdict
            if time.monotonic() < deadline:
                return LookupResult.HIT if hit else LookupResult.MISS
            self._forget(st, [key])
        if key not in st.pending:
            st.pending.add(key)
            self._batch.append((req_context.req_id, key))
        return LookupResult.RETRY

    def get_load_source(self, key, req_context):
        # A held object is in the owner's DRAM (a hold loads an SSD-resident one first).
        return CacheHitSource.HOST

    def prepare_load(self, keys, req_context):
        keys = list(keys)
        st = self._reqs.get(req_context.req_id)
        if st is None:
            st = self._reqs[req_context.req_id] = _Req()
        st.loading.update(keys)
        # Held chunks this load does not read are of no further use to the request.
        wanted = set(keys)
        self._forget(st, [k for k in list(st.held) if k not in wanted])
        return KvtideLoadStoreSpec(keys)

    def complete_load(self, keys, req_context):
        st = self._reqs.get(req_context.req_id)
        if st is None:
            return
        keys = list(keys)
        st.loading.difference_update(keys)
        self._release(st, keys)
        for k in keys:
            st.verdicts.pop(k, None)
        if st.finished and not st.loading:
            self._reqs.pop(req_context.req_id, None)

    def prepare_store(self, keys, req_context):
        st = self._reqs.get(req_context.req_id)
        to_store = []
        for key in keys:
            present = st is not None and st.verdicts.get(key, (False, 0))[0]
            if not present and key not in self._storing:
                to_store.append(key)
        for key in to_store:
            self._storing[key] = self._storing.get(key, 0) + 1
        return PrepareStoreOutput(keys_to_store=to_store, store_spec=KvtideLoadStoreSpec(to_store), evicted_keys=[])

    def complete_store(self, keys, req_context, success=True):
        keys = list(keys)
        for key in keys:
            n = self._storing.get(key, 0) - 1
            if n > 0:
                self._storing[key] = n
            else:
                self._storing.pop(key, None)
        if success and self._events_on and keys:
            self._events.append(OffloadingEvent(keys=keys, medium=Medium.CPU, removed=False,
                                                locality=self._locality, removal_expected=True,
                                                req_context=req_context))
            for key in keys:
                self._announced[key] = None
                self._announced.move_to_end(key)
            if len(self._announced) > _MAX_ANNOUNCED:
                old = []
                while len(self._announced) > _MAX_ANNOUNCED:
                    old.append(self._announced.popitem(last=False)[0])
                self._events.append(OffloadingEvent(keys=old, medium=Medium.CPU, removed=True,
                                                    locality=self._locality))

    def _announce_removed(self, keys):
        for key in keys:
            self._announced.pop(key, None)
        if self._events_on:
            self._events.append(OffloadingEvent(keys=list(keys), medium=Medium.CPU, removed=True,
                                                locality=self._locality))

    def on_request_finished(self, req_context):
        st = self._reqs.get(req_context.req_id)
        if st is None:
            return
        st.finished = True
        st.pending.clear()
        self._forget(st, list(st.held))
        st.verdicts.clear()
        if not st.loading:
            self._reqs.pop(req_context.req_id, None)

    def on_schedule_end(self, context):
        self._drain()
        self._drain_due = True
        if self._batch:
            batch, self._batch = self._batch, []
            self._in_flight += 1
            self._jobs.put((self._generation, batch))

    def has_pending_work(self):
        self._drain()
        return self._in_flight > 0 or bool(self._batch)

    def take_events(self):
        events, self._events = self._events, []
        yield from events

    def reset_cache(self):
        # kvtide's objects are shared with other engines and stay; this manager forgets what it
        # knew and gives its holds back.
        self._generation += 1
        self._batch = []
        for st in self._reqs.values():
            self._release(st, list(st.held))
            st.verdicts.clear()
            st.pending.clear()
            st.loading.clear()
        self._storing.clear()
        self._announced.clear()

    def shutdown(self):
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
            self._drain()
            self.reset_cache()
            self._spec.close()


# ---- the worker side -------------------------------------------------------------------------------


class _GroupLayout:
    """One KV cache group's chunk object: its data refs' page sizes and where each starts."""

    __slots__ = ("sizes", "starts", "chunk_bytes")

    def __init__(self, sizes, blocks_per_chunk):
        self.sizes = [int(s) for s in sizes]
        self.starts = []
        at = 0
        for s in self.sizes:
            self.starts.append(at)
            at += blocks_per_chunk * s
        self.chunk_bytes = at


def _plan(device_ptrs, keys, layouts, blocks_per_chunk):
    """Per chunk: (key, its group layout, [(device address, bytes, offset in the object)],
    whole) in vLLM's canonical pointer order. Raises ValueError when the pointers do not match
    the registered KV caches."""
    out = []
    key_idx = 0
    for g in iter_pointer_groups(device_ptrs, blocks_per_chunk):
        if g.group_idx >= len(layouts):
            raise ValueError(f"pointer group {g.group_idx} of {len(layouts)} registered groups")
        layout = layouts[g.group_idx]
        if g.n_data_refs != len(layout.sizes):
            raise ValueError(f"group {g.group_idx}: {g.n_data_refs} data refs, {len(layout.sizes)} registered")
        dev_blk = 0
        for i in range(g.n_chunks):
            if key_idx >= len(keys):
                raise ValueError(f"{len(keys)} keys for more chunks")
            start = g.skip if i == 0 else 0
            n_blks = min(blocks_per_chunk - start, g.group_size - dev_blk)
            ops = []
            for d in range(g.n_data_refs):
                base = g.dev_ptr_offset + d * g.group_size + dev_blk
                size = layout.sizes[d]
                for b in range(n_blks):
                    idx = base + b
                    if int(device_ptrs.sizes[idx]) != size:
                        raise ValueError(f"block of {int(device_ptrs.sizes[idx])} bytes where the registered "
                                         f"KV cache has {size}")
                    ops.append((int(device_ptrs.ptrs[idx]), size, layout.starts[d] + (start + b) * size))
            whole = start == 0 and n_blks == blocks_per_chunk
            out.append((keys[key_idx], layout, ops, whole))
            key_idx += 1
            dev_blk += n_blks
    if key_idx != len(keys):
        raise ValueError(f"{len(keys)} keys for {key_idx} chunks")
    return out


def _ready_event():
    """A CUDA event on the current stream, so a transfer starts after the KV it moves is written
    (None without CUDA)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - vLLM needs torch
        return None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        event = torch.cuda.Event()
        event.record()
        return event
    return None


def _is_int(r):
    return isinstance(r, int) and not isinstance(r, bool)


class KvtideOffloadingWorker(OffloadingWorker):
    """Worker side: a store writes each whole chunk's blocks as one object; a load reads them
    back (whole chunks with an exact size check, partial ones by range after a size check).
    Jobs run on a thread pool (kvtide releases the GIL while it moves bytes), expedited loads
    on their own thread; ``get_finished`` reports each job once."""

    def __init__(self, spec, kv_caches):
        tensors = list(kv_caches.tensors)
        on_device = [t.tensor.device.type for t in tensors if t.tensor.device.type != "cpu"]
        if on_device and not kvtide.cuda_built():
            raise ConfigError(f"kvtide.vllm: the KV cache is on {on_device[0]}, but this kvtide build has no CUDA "
                              "transport (build the package with the cuda feature)")
        self._spec = spec
        self._store = spec.store
        self._prefix = spec.namespace.prefix
        self._bpc = spec.blocks_per_chunk
        self._layouts = [_GroupLayout([r.page_size_bytes for r in refs], self._bpc)
                         for refs in kv_caches.group_data_refs]
        threads = spec.settings.threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtide-vllm")
        self._expedited = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtide-vllm-expedited")
        self._jobs = {}
        self._lock = threading.Lock()

    def _name(self, key):
        return f"{self._prefix}/{bytes(key).hex()}"

    def _submit(self, job_id, pool, fn, device_ptrs, keys):
        event = _ready_event()
        started = time.perf_counter()

        def run():
            if event is not None:
                event.synchronize()
            return fn(_plan(device_ptrs, keys, self._layouts, self._bpc))

        with self._lock:
            self._jobs[job_id] = (pool.submit(run), started)
        return True

    def _store_chunks(self, chunks):
        # An object is a whole chunk: a store that starts or ends inside one cannot write it.
        whole = [c for c in chunks if c[3]]
        names = [self._name(key) for key, _, _, _ in whole]
        sources = [[(ptr, size) for ptr, size, _ in ops] for _, _, ops, _ in whole]
        sizes = [layout.chunk_bytes for _, layout, _, _ in whole]
        results = self._store.batch_put_from_multi_buffers(names, sources) if whole else []
        stored = settle_puts(self._store, names, sizes, results)
        ok = len(whole) == len(chunks) and all(stored)
        return ok, sum(sizes)

    def _load_chunks(self, chunks):
        whole = [c for c in chunks if c[3]]
        part = [c for c in chunks if not c[3]]
        ok = True
        if whole:
            names = [self._name(key) for key, _, _, _ in whole]
            dsts = [[(ptr, size) for ptr, size, _ in ops] for _, _, ops, _ in whole]
            results = self._store.batch_get_into_multi_buffers(names, dsts)
            ok = all(_is_int(r) and r == layout.chunk_bytes for r, (_, layout, _, _) in zip(results, whole))
        if part and ok:
            names = [self._name(key) for key, _, _, _ in part]
            # A range read checks only its range: the object must also be a whole chunk.
            sizes = self._store.batch_get_size(names)
            ok = all(_is_int(s) and s == layout.chunk_bytes for s, (_, layout, _, _) in zip(sizes, part))
            if ok:
                buffers, fragments = [], []
                for name, (_, _, ops, _) in zip(names, part):
                    for ptr, size, offset in ops:
                        buffers.append((ptr, size))
                        fragments.append([(name, offset, 0, size)])
                results = self._store.get_into_ranges(buffers, fragments)
                ok = all(_is_int(r) for per in results for r in per) and len(results) == len(buffers)
        return ok, sum(size for _, _, ops, _ in chunks for _, size, _ in ops)

    def submit_store(self, job_id, device_ptrs, dst_spec):
        return self._submit(job_id, self._pool, self._store_chunks, device_ptrs, dst_spec.keys)

    def submit_load(self, job_id, src_spec, device_ptrs, expedited=False):
        pool = self._expedited if expedited else self._pool
        return self._submit(job_id, pool, self._load_chunks, device_ptrs, src_spec.keys)

    def get_finished(self):
        done = []
        with self._lock:
            for job_id, (future, started) in list(self._jobs.items()):
                if future.done():
                    del self._jobs[job_id]
                    try:
                        ok, size = future.result()
                    except Exception as e:  # a failed transfer is reported, never raised
                        logger.warning("kvtide.vllm: transfer job %d failed: %s", job_id, e)
                        ok, size = False, None
                    done.append(TransferResult(job_id=job_id, success=bool(ok), transfer_size=size,
                                               transfer_time=time.perf_counter() - started))
        return done

    def wait(self, job_ids):
        with self._lock:
            futures = [self._jobs[j][0] for j in job_ids if j in self._jobs]
        for f in futures:
            f.exception()

    def shutdown(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._expedited.shutdown(wait=True)
            self._pool = None
            self._spec.close()
