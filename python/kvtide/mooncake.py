"""Mooncake Store's Python API on kvtide.

Owns ``MooncakeDistributedStore`` and the types Mooncake's ``mooncake.store`` module gives with
it (``ReplicateConfig``, ``SoftPinAction``, ``ObjectDataType``, ``BufferHandle``, ``BufferPool``
and the tensor-object helpers ``_serialize_tensor`` / ``_deserialize_tensor`` /
``_tensor_metadata_size``), with the names, signatures, argument checks and return conventions
of Mooncake commit 3b5a5941 (2026-08-22; the core API of v0.3.12.post1): methods return ``0`` or
a byte count on success and a negative Mooncake ``ErrorCode`` on failure instead of raising;
``get`` returns ``b""`` on a miss; ``put`` of an existing key returns 0 and keeps the old value.
Tensors are stored in Mooncake's own object layout (a 304-byte ``TensorMetadata`` then the
bytes), so tensors written by either read back through the other. Code written against Mooncake
switches by changing the import::

    from kvtide.mooncake import MooncakeDistributedStore

``setup``'s ``master_server_addr`` picks the store: ``"embedded"`` (or ``""``) opens kvtide
embedded in this process with ``global_segment_size`` bytes of DRAM (and an SSD tier in
``ssd_offload_path`` when ``enable_ssd_offload``); anything else is a ``kvtide-owner`` address
(``"unix:/run/kvtide/owner.sock"``, a socket path, or ``"host:port"``; ``KVTIDE_TOKEN_FILE``
gives a TCP owner's token), or a kvtide cluster, ``"etcd://HOST:PORT[,HOST:PORT...]/NAME"``
(``kvtide.connect_cluster``; NAME defaults to ``kvtide``).

It never reproduces Mooncake's cluster machinery (masters, segments, replicas, transfer tasks,
RDMA): those methods are absent (``AttributeError``), and every difference is listed in
docs/python.md. The hot paths (``put``, ``get``, ``get_into``, ``put_from`` and their batches)
are one kvtide call plus the checks Mooncake makes, so the class costs what ``kvtide.Store``
costs (python/bench/mooncake_overhead.py measures it).
"""

import bisect
import ctypes
import enum
import functools
import mmap
import operator
import re
import socket
import struct
import threading
import time
import weakref

import kvtide


def _cluster_address(address):
    """``etcd://HOST:PORT[,...]/NAME`` as (etcd endpoints, cluster name)."""
    scheme, rest = address.split("://", 1)
    endpoints, _, name = rest.partition("/")
    return f"{scheme}://{endpoints}", name or "kvtide"


# Keys per scan page when removing by pattern.
_SCAN_PAGE = 4096

# Mooncake's ErrorCode values (mooncake-store/include/types.h).
OK = 0
INTERNAL_ERROR = -1
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
ILLEGAL_CLIENT = -601
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
TRANSFER_FAIL = -800
CHECKSUM_MISMATCH = -801
RPC_FAIL = -900
RPC_TIMEOUT = -901
NOT_SUPPORTED = -1012
FILE_NOT_FOUND = -1100
DFS_SERVICE_UNAVAILABLE = -1601

_CODES = [
    (kvtide.NotFound, OBJECT_NOT_FOUND),
    (kvtide.AlreadyExists, OBJECT_ALREADY_EXISTS),
    (kvtide.NoSpace, NO_AVAILABLE_HANDLE),
    (kvtide.Busy, NO_AVAILABLE_HANDLE),
    (kvtide.InvalidArgument, INVALID_PARAMS),
    (kvtide.TooLarge, INVALID_PARAMS),
    (kvtide.NotPinned, INVALID_PARAMS),
    (kvtide.ShuttingDown, INVALID_PARAMS),
    (kvtide.Leased, OBJECT_HAS_LEASE),
    (kvtide.Pinned, OBJECT_HAS_LEASE),
    (kvtide.LeaseExpired, LEASE_EXPIRED),
    (kvtide.ProducerAborted, REPLICA_IS_NOT_READY),
    (kvtide.Corrupted, CHECKSUM_MISMATCH),
    (kvtide.CudaUnavailable, TRANSFER_FAIL),
    (kvtide.CudaError, TRANSFER_FAIL),
    (kvtide.StreamError, TRANSFER_FAIL),
    (kvtide.Disconnected, RPC_FAIL),
    (kvtide.ProtocolError, RPC_FAIL),
    (kvtide.Timeout, RPC_TIMEOUT),
    (kvtide.Unauthorized, ILLEGAL_CLIENT),
]
# Exact classes first: one dict lookup on the error path instead of an isinstance chain.
_CODE_OF = {cls: code for cls, code in reversed(_CODES)}
for _cls in (kvtide.SizeMismatch, kvtide.BufferTooSmall):
    _CODE_OF[_cls] = INVALID_PARAMS
for _cls in (kvtide.StreamCapturing, kvtide.StreamExpired):
    _CODE_OF[_cls] = TRANSFER_FAIL

_KvtideError = kvtide.KvtideError
_AlreadyExists = kvtide.AlreadyExists


def error_code(exc):
    """The Mooncake ErrorCode for a kvtide exception."""
    code = _CODE_OF.get(type(exc))
    if code is not None:
        return code
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return INTERNAL_ERROR


def _ints(results, ok=None):
    """Per-key kvtide results as Mooncake ints (exceptions as their codes)."""
    if ok is None:
        return [r if type(r) is int else error_code(r) for r in results]
    return [ok if r is None else error_code(r) for r in results]


# ---- argument types, as pybind11 converts them (checked where Mooncake's binding would) ------

_U64 = 1 << 64


def _uint(value, what):
    """A size_t / uintptr_t argument: an int in [0, 2**64), else TypeError (pybind11's)."""
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an unsigned integer, got {type(value).__name__}") from None
    if not 0 <= v < _U64:
        raise TypeError(f"{what} must be an unsigned 64-bit integer, got {v}")
    return v


def _key(key):
    if type(key) is not str and type(key) is not bytes:
        raise TypeError(f"key must be a str, got {type(key).__name__}")
    return key


def _keys(keys):
    if isinstance(keys, (str, bytes)):
        raise TypeError("keys must be a list of str, not one str")
    out = list(keys)
    for k in out:
        _key(k)
    return out


def _uints(values, what):
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{what} must be a list of unsigned integers")
    return [_uint(v, what) for v in values]


def _nbytes(value):
    """Bytes of a buffer-protocol value (Mooncake's ``py::buffer``); TypeError otherwise."""
    return memoryview(value).nbytes


def _failed(e, key, ints=()):
    """The code for a failed call; the TypeError Mooncake's binding raises instead when an
    argument was of the wrong type (checked only after kvtide refused it, off the hot path)."""
    if isinstance(e, kvtide.InvalidArgument):
        _raise_type_errors(key, ints)
    return error_code(e)


def _raise_type_errors(key=None, ints=()):
    """On kvtide's InvalidArgument: the TypeError Mooncake's binding raises for these arguments,
    if one of them is of the wrong type (checked only after a call failed, off the hot path)."""
    if key is not None:
        _key(key)
    for value, what in ints:
        _uint(value, what)


# ---- Mooncake's enums and ReplicateConfig -----------------------------------------------------


class SoftPinAction(enum.IntEnum):
    """How a put or upsert changes an object's soft pin (Mooncake's ``SoftPinAction``)."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(enum.IntEnum):
    """Mooncake's object classification (recorded with the config; kvtide ignores it)."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


# Mooncake master defaults (types.h): a soft pin lasts at most 24 hours.
MAX_SOFT_PIN_TTL_MS = 24 * 60 * 60 * 1000


def _str_list(value, what):
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{what} must be a list of str")
    out = list(value)
    if not all(isinstance(s, str) for s in out):
        raise TypeError(f"{what} must be a list of str")
    return out


class ReplicateConfig:
    """Mooncake's ReplicateConfig, with its field types checked on assignment (TypeError, as
    pybind11's setters). kvtide keeps one copy per store: the replica counts and placement
    fields are validated as Mooncake's master validates them and otherwise recorded;
    ``with_hard_pin`` pins the object (never evicted until unpinned or removed with force); the
    soft-pin fields are validated (a TTL needs ``SoftPinAction.ENABLE``, at most 24 hours) and
    have no eviction effect; ``prefer_alloc_in_same_node`` makes writes return INVALID_PARAMS,
    as Mooncake's client does."""

    __slots__ = ("_replica_num", "_nof_replica_num", "_dfs_replica_num", "_soft_pin_action",
                 "_soft_pin_ttl_ms", "_with_hard_pin", "_preferred_segments", "_preferred_nof_segments",
                 "_preferred_segment", "_prefer_alloc_in_same_node", "_data_type", "_group_ids")

    def __init__(self):
        self._replica_num = 1
        self._nof_replica_num = 0
        self._dfs_replica_num = 0
        self._soft_pin_action = SoftPinAction.PRESERVE
        self._soft_pin_ttl_ms = None
        self._with_hard_pin = False
        self._preferred_segments = []
        self._preferred_nof_segments = []
        self._preferred_segment = ""
        self._prefer_alloc_in_same_node = False
        self._data_type = ObjectDataType.UNKNOWN
        self._group_ids = None

    def _field(name, convert):
        """A property stored in ``_<name>`` whose setter converts (and checks) with ``convert``."""
        def get(self):
            return getattr(self, "_" + name)

        def set(self, value):
            setattr(self, "_" + name, convert(value))

        return property(get, set)

    def _instance_of(kind, name, what=None):
        def convert(value):
            if not isinstance(value, kind):
                raise TypeError(what or f"{name} must be a {kind.__name__}, got {type(value).__name__}")
            return value
        return convert

    replica_num = _field("replica_num", lambda v: _uint(v, "replica_num"))
    nof_replica_num = _field("nof_replica_num", lambda v: _uint(v, "nof_replica_num"))
    dfs_replica_num = _field("dfs_replica_num", lambda v: _uint(v, "dfs_replica_num"))
    soft_pin_action = _field("soft_pin_action", _instance_of(SoftPinAction, "soft_pin_action"))
    soft_pin_ttl_ms = _field("soft_pin_ttl_ms", lambda v: None if v is None else _uint(v, "soft_pin_ttl_ms"))
    with_hard_pin = _field("with_hard_pin", bool)
    preferred_segments = _field("preferred_segments", lambda v: _str_list(v, "preferred_segments"))
    preferred_nof_segments = _field("preferred_nof_segments", lambda v: _str_list(v, "preferred_nof_segments"))
    preferred_segment = _field("preferred_segment", _instance_of(str, "preferred_segment",
                                                                 "preferred_segment must be a str"))
    prefer_alloc_in_same_node = _field("prefer_alloc_in_same_node", bool)
    data_type = _field("data_type", _instance_of(ObjectDataType, "data_type"))
    group_ids = _field("group_ids", lambda v: None if v is None else _str_list(v, "group_ids"))

    del _field, _instance_of

    def __str__(self):
        ttl = "default" if self._soft_pin_ttl_ms is None else str(self._soft_pin_ttl_ms)
        text = (f"ReplicateConfig: {{ replica_num: {self._replica_num}, nof_replica_num: {self._nof_replica_num}, "
                f"dfs_replica_num: {self._dfs_replica_num}, soft_pin_action: {self._soft_pin_action.name}, "
                f"soft_pin_ttl_ms: {ttl}, with_hard_pin: {int(self._with_hard_pin)}, "
                f"preferred_segments: [{', '.join(self._preferred_segments)}]")
        if self._preferred_segment:
            text += f", preferred_segment (deprecated): {self._preferred_segment}"
        text += (f", preferred_nof_segments: [{', '.join(self._preferred_nof_segments)}], "
                 f"prefer_alloc_in_same_node: {int(self._prefer_alloc_in_same_node)}, "
                 f"data_type: {self._data_type.name}")
        if self._group_ids is not None:
            text += f", group_ids: [{', '.join(self._group_ids)}]"
        return text + " }"

    __repr__ = __str__


def _config_code(config, keys=1):
    """0, or the code Mooncake's client or master answers for this config (checked per write,
    since a config is mutable): unsupported placement, no replica, DFS or NoF replicas (kvtide
    has neither tier), a soft-pin TTL without ENABLE or over 24 hours, group ids not one per key."""
    if not isinstance(config, ReplicateConfig):
        raise TypeError(f"config must be a ReplicateConfig, got {type(config).__name__}")
    if config._prefer_alloc_in_same_node:
        return INVALID_PARAMS
    if config._replica_num == 0 and config._nof_replica_num == 0 and config._dfs_replica_num == 0:
        return INVALID_PARAMS
    if config._dfs_replica_num > 1 or (config._dfs_replica_num and not config._replica_num):
        return INVALID_PARAMS
    if config._dfs_replica_num:
        return DFS_SERVICE_UNAVAILABLE
    if config._nof_replica_num:
        return INVALID_PARAMS
    ttl = config._soft_pin_ttl_ms
    if ttl is not None and (config._soft_pin_action != SoftPinAction.ENABLE or ttl > MAX_SOFT_PIN_TTL_MS):
        return INVALID_PARAMS
    if config._group_ids is not None and len(config._group_ids) != keys:
        return INVALID_PARAMS
    return OK


def _without_groups(config):
    """A copy of ``config`` without group ids (checked already against the caller's keys)."""
    copy = ReplicateConfig.__new__(ReplicateConfig)
    for name in ReplicateConfig.__slots__:
        setattr(copy, name, getattr(config, name))
    copy._group_ids = None
    return copy


# ---- buffers ----------------------------------------------------------------------------------


class BufferHandle(bytearray):
    """What ``get_buffer`` returns: the object's bytes (a buffer: ``memoryview(h)``,
    ``numpy.frombuffer(h, numpy.uint8)``), with Mooncake's ``ptr()`` and ``size()``."""

    def ptr(self):
        if len(self) == 0:
            return 0
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

    def size(self):
        return len(self)


class _Region:
    """Anonymous host memory (pages committed on first touch), freed when the last holder drops
    it: a store's local buffer, a memory-pool allocation, a BufferPool overflow region."""

    __slots__ = ("_map", "_anchor", "base", "size", "__weakref__")

    def __init__(self, size, alignment=4096):
        # Over-allocate so the usable range can start on `alignment` (mmap gives pages).
        extra = alignment if alignment > mmap.PAGESIZE else 0
        self._map = mmap.mmap(-1, max(size + extra, 1))
        self._anchor = ctypes.c_char.from_buffer(self._map)
        start = ctypes.addressof(self._anchor)
        self.base = (start + alignment - 1) // alignment * alignment if extra else start
        self.size = size

    def __del__(self):
        try:
            del self._anchor
            self._map.close()
        except Exception:
            pass


class _RangeAllocator:
    """First-fit allocator over one region, 64-byte aligned, freed ranges coalesced. Bounded
    by the region; every live allocation counted."""

    ALIGN = 64

    def __init__(self, region):
        self.region = region
        self._free = [(region.base, region.size)]  # sorted (start, length)
        self._used = {}
        self._lock = threading.Lock()

    def allocate(self, size):
        need = max((size + self.ALIGN - 1) // self.ALIGN * self.ALIGN, self.ALIGN)
        with self._lock:
            for i, (start, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[i]
                    else:
                        self._free[i] = (start + need, length - need)
                    self._used[start] = need
                    return start
        return None

    def free(self, ptr):
        with self._lock:
            length = self._used.pop(ptr)
            i = bisect.bisect_left(self._free, (ptr, 0))
            self._free.insert(i, (ptr, length))
            # Merge with the next and the previous free range.
            if i + 1 < len(self._free) and ptr + length == self._free[i + 1][0]:
                self._free[i] = (ptr, length + self._free[i + 1][1])
                del self._free[i + 1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == ptr:
                self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
                del self._free[i]

    def in_use(self):
        with self._lock:
            return len(self._used), sum(self._used.values())


def _not_set_up(*args, **kwargs):
    raise kvtide.ShuttingDown("the store is not set up (call setup) or is closed")


def _free_port(host_part):
    """Mooncake's client port: a free TCP port in [MC_STORE_CLIENT_MIN_PORT, MAX] (12300-14300),
    held by a bound socket until close so two clients on a host never share a name."""
    import os
    import random

    def env_int(name, default):
        try:
            return int(os.environ.get(name, default))
        except ValueError:
            return default

    lo, hi = env_int("MC_STORE_CLIENT_MIN_PORT", 12300), env_int("MC_STORE_CLIENT_MAX_PORT", 14300)
    if not (0 < lo <= hi <= 65535):
        lo, hi = 12300, 14300
    for _ in range(20):
        port = random.randint(lo, hi)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("", port))
            return port, sock
        except OSError:
            sock.close()
    return None, None


def _has_port(hostname):
    if hostname.startswith("["):
        end = hostname.find("]")
        return end > 0 and hostname[end + 1:end + 2] == ":" and hostname[end + 2:].isdigit()
    host, sep, port = hostname.rpartition(":")
    return bool(sep) and bool(host) and ":" not in host and port.isdigit()


def _get_failed(e, key):
    if isinstance(e, kvtide.InvalidArgument):
        _key(key)
    return b""


_FAST_PATHS = ("put", "upsert", "get", "get_into", "put_from", "batch_get_into")


def _install_fast_paths(self, store):
    """The hot calls as closures on the instance (shadowing the methods of the same name, which
    stay the reference and the slow path): each is one kvtide call behind the checks Mooncake
    makes, with no attribute lookups. Through an owner every Python bytecode around the call
    runs on cold caches after the round trip, so each one saved shows (docs/benchmarks.md, "The
    Mooncake class's cost"). A subclass that overrides one of these methods keeps its own. The
    closures hold the instance weakly, so dropping it still frees the store."""
    cls = MooncakeDistributedStore
    ref = weakref.ref(self)

    def me():
        # The instance, or a fresh (not set up) one if it was dropped while a closure was kept.
        return ref() or cls()

    staging = self._staging
    s_put, s_get, s_get_into, s_put_from, s_batch_get_into = (store.put, store.get, store.get_into, store.put_from,
                                                              store.batch_get_into)
    s_upsert = functools.partial(store.put, upsert=True)
    AE, KE, code_of = _AlreadyExists, _KvtideError, _CODE_OF
    # Builtins as closure cells too: a global lookup is two dict probes, cold after a round trip.
    type_, bytes_, len_, int_, list_, zip_ = type, bytes, len, int, list, zip

    def put(key, value, config=None):
        if config is None and type_(value) is bytes_ and value and staging:
            try:
                s_put(key, value)
            except AE:
                pass
            except KE as e:
                return _failed(e, key)
            return 0
        return cls.put(me(), key, value, config)

    def upsert(key, value, config=None):
        if config is None and type_(value) is bytes_ and value and staging:
            try:
                s_upsert(key, value)
            except KE as e:
                return _failed(e, key)
            return 0
        return cls.upsert(me(), key, value, config)

    def get(key):
        try:
            return s_get(key)
        except KE as e:
            return _get_failed(e, key)

    def get_into(key, buffer_ptr, size):
        try:
            return s_get_into(key, (buffer_ptr, size))
        except KE as e:
            return _failed(e, key, ((buffer_ptr, "buffer_ptr"), (size, "size")))

    def put_from(key, buffer_ptr, size, config=None):
        if size and config is None:
            try:
                s_put_from(key, (buffer_ptr, size))
            except AE:
                pass
            except KE as e:
                return _failed(e, key, ((buffer_ptr, "buffer_ptr"), (size, "size")))
            return 0
        return cls.put_from(me(), key, buffer_ptr, size, config)

    def batch_get_into(keys, buffer_ptrs, sizes):
        if keys and len_(keys) == len_(buffer_ptrs) == len_(sizes):
            return [r if type_(r) is int_ else code_of.get(type_(r)) or error_code(r)
                    for r in s_batch_get_into(keys, list_(zip_(buffer_ptrs, sizes)))]
        return cls.batch_get_into(me(), keys, buffer_ptrs, sizes)

    for fn in (put, upsert, get, get_into, put_from, batch_get_into):
        method = getattr(cls, fn.__name__)
        if getattr(type(self), fn.__name__) is method:
            fn.__doc__, fn.__qualname__ = method.__doc__, method.__qualname__
            self.__dict__[fn.__name__] = fn


class MooncakeDistributedStore:
    """Mooncake Store's client class, on a kvtide store (embedded or through an owner)."""

    def __init__(self):
        self._store = None
        self._hostname = ""
        self._port_socket = None
        self._dummy = False
        self._staging = False
        self._local_buffer_size = 0
        self._local = None
        self._local_lock = threading.Lock()
        self._registered = {}
        self._bases = []  # sorted bases of self._registered
        # Registrations and pool allocations change from any thread (a BufferPool's overflow).
        self._regions_lock = threading.Lock()
        self._pool_regions = {}
        self._pool_limit = 0
        self._pool_bytes = 0
        self._bind(None)

    def _bind(self, store):
        """The bound kvtide methods the hot paths call (a stub that raises ShuttingDown, which
        answers INVALID_PARAMS, when not set up)."""
        for name in ("put", "get", "get_into", "put_from", "batch_get_into", "batch_put_from",
                     "get_size", "exists", "remove"):
            setattr(self, "_" + name, getattr(store, name) if store is not None else _not_set_up)
        self._upsert = functools.partial(store.put, upsert=True) if store is not None else _not_set_up
        self._upsert_from = functools.partial(store.put_from, upsert=True) if store is not None else _not_set_up
        for name in _FAST_PATHS:
            self.__dict__.pop(name, None)
        if store is not None:
            _install_fast_paths(self, store)

    # ---- setup and lifecycle -----------------------------------------------------------------

    def setup(self, local_hostname=None, metadata_server=None, global_segment_size=None, local_buffer_size=None,
              protocol=None, rdma_devices=None, master_server_addr=None, engine=None, enable_ssd_offload=False,
              ssd_offload_path="", tenant_id="default", enable_client_http_server=False, client_http_port=9300,
              config=None):
        """Mooncake's ``setup``: positionally, the first seven arguments are required; or one
        dict with ``local_hostname`` and ``metadata_server`` required and the rest optional
        (sizes as numbers or text such as "16MB"). Returns 0, or INVALID_PARAMS (bad
        arguments, or kvtide could not open) or RPC_FAIL (no owner at ``master_server_addr``)."""
        if config is not None or isinstance(local_hostname, dict):
            if metadata_server is not None or (config is not None and local_hostname is not None):
                raise TypeError("setup() takes one config dict, or the positional arguments")
            config = local_hostname if config is None else config
            if not isinstance(config, dict):
                raise TypeError("setup()'s config must be a dict")
            return self._setup_dict(config)
        required = (local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol, rdma_devices,
                    master_server_addr)
        if any(a is None for a in required):
            raise TypeError("setup() takes local_hostname, metadata_server, global_segment_size, local_buffer_size, "
                            "protocol, rdma_devices and master_server_addr, or one config dict")
        for value, what in ((local_hostname, "local_hostname"), (metadata_server, "metadata_server"),
                            (protocol, "protocol"), (rdma_devices, "rdma_devices"),
                            (master_server_addr, "master_server_addr"), (ssd_offload_path, "ssd_offload_path"),
                            (tenant_id, "tenant_id")):
            if not isinstance(value, str):
                raise TypeError(f"{what} must be a str, got {type(value).__name__}")
        segment = _uint(global_segment_size, "global_segment_size")
        local = _uint(local_buffer_size, "local_buffer_size")
        return self._setup(local_hostname, segment, local, master_server_addr, bool(enable_ssd_offload),
                           ssd_offload_path, dummy=False, protocol=protocol)

    def _setup_dict(self, config):
        cfg = {str(k): str(v) for k, v in config.items()}
        if not cfg.get("local_hostname") or not cfg.get("metadata_server"):
            return INVALID_PARAMS
        segment = _parse_size(cfg.get("global_segment_size"), 16 << 20)
        local = _parse_size(cfg.get("local_buffer_size"), 16 << 20)
        if segment is None or local is None:
            return INVALID_PARAMS
        # Mooncake's bounds: 0, or at least 1 KiB (and the local buffer at most 1 TiB).
        if (segment and segment < 1024) or (local and local < 1024) or local > 1 << 40:
            return INVALID_PARAMS
        port = cfg.get("client_http_port", "9300").strip()
        if not re.fullmatch(r"[+-]?\d+", port):
            return INVALID_PARAMS
        ssd = _parse_bool(cfg.get("enable_ssd_offload"), False)
        return self._setup(cfg["local_hostname"], segment, local, cfg.get("master_server_addr", "127.0.0.1:50051"),
                           ssd, cfg.get("ssd_offload_path", ""), dummy=False, protocol=cfg.get("protocol", "tcp"))

    def _setup(self, hostname, segment_bytes, local_bytes, address, ssd, ssd_path, dummy, protocol="tcp"):
        if not hostname:
            return INVALID_PARAMS
        # protocol="rdma": reads over the owner's UCX plane on its RDMA transports (over TCP, with
        # a warning, where the owner serves none or this host has no RDMA device).
        ucx = "rdma" if str(protocol).strip().lower() == "rdma" else None
        try:
            if address in ("", "embedded"):
                settings = {"dram_bytes": max(segment_bytes, 16 << 20)}
                if ssd and ssd_path:
                    settings["ssd_dir"] = ssd_path
                store = kvtide.Store(env=True, **settings)
            elif address.startswith(("etcd://", "etcds://")):
                store = kvtide.connect_cluster(*_cluster_address(address), ucx=ucx)
            else:
                store = kvtide.connect(address, ucx=ucx)
        except kvtide.KvtideError as e:
            return error_code(e) if not isinstance(e, kvtide.InvalidArgument) else INVALID_PARAMS
        port_socket = None
        if not dummy and not _has_port(hostname):
            port, port_socket = _free_port(hostname)
            if port is None:
                store.close()
                return INTERNAL_ERROR
            hostname = f"{hostname}:{port}"
        self.close()
        self._store = store
        self._hostname = "" if dummy else hostname  # Mooncake's dummy client has no hostname
        self._port_socket = port_socket
        self._dummy = dummy
        self._local_buffer_size = local_bytes
        # Mooncake's copying writes stage values in the local buffer: with none they fail.
        # kvtide copies from the caller's memory, so a nonzero size limits nothing.
        self._staging = local_bytes > 0
        self._bind(store)  # last: the fast paths capture the settings above
        return OK

    def setup_dummy(self, mem_pool_size, local_buffer_size, server_address):
        """Mooncake's client of a separate store process: here, a kvtide owner at
        ``server_address``. ``alloc_from_mem_pool`` hands out up to ``mem_pool_size`` bytes."""
        pool = _uint(mem_pool_size, "mem_pool_size")
        local = _uint(local_buffer_size, "local_buffer_size")
        if not isinstance(server_address, str):
            raise TypeError("server_address must be a str")
        code = self._setup(server_address, 0, local, server_address, False, "", dummy=True)
        if code == OK:
            self._pool_limit = pool
        return code

    def init_all(self, protocol, device_name, mount_segment_size=16 << 20):
        """Mooncake's legacy helper: INVALID_PARAMS once set up, as Mooncake's; otherwise an
        embedded store of ``mount_segment_size`` bytes and a 1 GiB local buffer."""
        if self._store is not None:
            return INVALID_PARAMS
        segment = _uint(mount_segment_size, "mount_segment_size")
        return self._setup("localhost:12345", segment, 1 << 30, "embedded", False, "", dummy=False)

    def close(self):
        """Closes the store (an embedded one shuts down cleanly), drops the registrations and
        the memory-pool allocations. Idempotent; returns 0."""
        if self._store is not None:
            self._store.close()
            self._store = None
        self._bind(None)
        if self._port_socket is not None:
            self._port_socket.close()
            self._port_socket = None
        self._hostname = ""
        with self._regions_lock:
            self._registered = {}
            self._bases = []
            self._pool_regions = {}
            self._pool_bytes = 0
            self._pool_limit = 0
        self._staging = False
        self._local_buffer_size = 0
        # A BufferPool keeps the local buffer it leases from alive; this store lets go of it.
        self._local = None
        return OK

    def health_check(self):
        """0 healthy, 1 not set up (or closed), 2 the owner is unreachable."""
        if self._store is None:
            return 1
        try:
            self._store.max_value_bytes()
            return 0
        except kvtide.KvtideError:
            return 2

    def get_hostname(self):
        """``host:port``: the port given in ``local_hostname``, else one reserved at setup."""
        return self._hostname

    # ---- writes --------------------------------------------------------------------------------

    def _write(self, key, value, config, upsert):
        """put / upsert with a config: validated as Mooncake validates it; hard pin honoured."""
        code = _config_code(config)
        if code:
            return code
        if self._store is None:
            return INVALID_PARAMS
        try:
            self._store.put(key, value, upsert=upsert, pin=config._with_hard_pin)
        except _AlreadyExists:
            pass
        except _KvtideError as e:
            return _failed(e, key)
        return OK

    def put(self, key, value, config=None):
        """0 (also when the key exists: the old value is kept), or a negative code. An empty
        value, or any value when ``local_buffer_size`` is 0 (Mooncake stages it there), is
        INVALID_PARAMS; a non-buffer raises TypeError."""
        n = len(value) if type(value) is bytes else _nbytes(value)
        if n == 0 or not self._staging:
            return INVALID_PARAMS
        if config is not None:
            return self._write(key, value, config, False)
        try:
            self._put(key, value)
        except _AlreadyExists:
            pass
        except _KvtideError as e:
            return _failed(e, key)
        return OK

    def upsert(self, key, value, config=None):
        """``put`` that replaces an existing value."""
        n = len(value) if type(value) is bytes else _nbytes(value)
        if n == 0 or not self._staging:
            return INVALID_PARAMS
        if config is None:
            try:
                self._upsert(key, value)
            except _KvtideError as e:
                return _failed(e, key)
            return OK
        return self._write(key, value, config, True)

    def _parts(self, key, parts, config, upsert):
        views = []
        total = 0
        for p in parts:
            v = memoryview(p)
            if v.ndim != 1 or v.itemsize != 1:
                raise RuntimeError("parts must be 1-D bytes-like")
            views.append(v)
            total += v.nbytes
        if self._store is None:
            return INVALID_PARAMS
        code = _config_code(config) if config is not None else OK
        if code:
            return code
        if total == 0:
            return OK  # Mooncake stores nothing and reports success
        if not self._staging:
            return INVALID_PARAMS
        try:
            self._store.put_from(key, views, upsert=upsert, pin=config is not None and config._with_hard_pin)
        except _AlreadyExists:
            pass
        except _KvtideError as e:
            return _failed(e, key)
        return OK

    def put_parts(self, key, *parts, config=None):
        """The parts gathered into one object; RuntimeError for a part that is not 1-D bytes."""
        return self._parts(key, parts, config, False)

    def upsert_parts(self, key, *parts, config=None):
        return self._parts(key, parts, config, True)

    def _batch(self, keys, values, config, upsert):
        """put_batch / upsert_batch: one int, 0 or the first failing key's code."""
        if self._store is None:
            return INVALID_PARAMS
        keys = _keys(keys)
        values = list(values)
        sizes = [_nbytes(v) for v in values]
        code = _config_code(config, len(keys)) if config is not None else OK
        if code:
            return code
        if len(keys) != len(values) or 0 in sizes or not self._staging:
            return INVALID_PARAMS
        pin = config is not None and config._with_hard_pin
        for r in self._store.batch_put_from(keys, values, upsert=upsert, pin=pin):
            if r is not None and type(r) is not _AlreadyExists:
                return error_code(r)
        return OK

    def put_batch(self, keys, values, config=None):
        return self._batch(keys, values, config, False)

    def upsert_batch(self, keys, values, config=None):
        return self._batch(keys, values, config, True)

    def put_from(self, key, buffer_ptr, size, config=None):
        """From caller memory ``[buffer_ptr, +size)``: 0 (size 0 stores nothing), or a code."""
        if config is not None:
            return self._write_from(key, buffer_ptr, size, config, False)
        if size == 0 and self._store is not None:
            return OK
        try:
            self._put_from(key, (buffer_ptr, size))
        except _AlreadyExists:
            pass
        except _KvtideError as e:
            return _failed(e, key, ((buffer_ptr, "buffer_ptr"), (size, "size")))
        return OK

    def upsert_from(self, key, buffer_ptr, size, config=None):
        if config is not None:
            return self._write_from(key, buffer_ptr, size, config, True)
        if size == 0 and self._store is not None:
            return OK
        try:
            self._upsert_from(key, (buffer_ptr, size))
        except _KvtideError as e:
            return _failed(e, key, ((buffer_ptr, "buffer_ptr"), (size, "size")))
        return OK

    def _write_from(self, key, buffer_ptr, size, config, upsert):
        if self._store is None:
            return INVALID_PARAMS
        code = _config_code(config)
        if code:
            return code
        if _uint(size, "size") == 0:
            return OK
        try:
            self._store.put_from(key, (_uint(buffer_ptr, "buffer_ptr"), size), upsert=upsert,
                                 pin=config._with_hard_pin)
        except _AlreadyExists:
            pass
        except _KvtideError as e:
            return _failed(e, key)
        return OK

    def _batch_from(self, keys, sources, config, upsert):
        """Per-key codes of a batch write from caller memory (an existing key is success)."""
        pin = False
        if config is not None:
            code = _config_code(config, len(keys))
            if code:
                return [code] * len(keys)
            pin = config._with_hard_pin
        try:
            results = self._store.batch_put_from_multi_buffers(keys, sources, upsert=upsert, pin=pin)
        except kvtide.InvalidArgument:
            _keys(keys)  # the TypeError Mooncake raises for keys that are not str
            return [INVALID_PARAMS] * len(keys)
        return [OK if r is None or type(r) is _AlreadyExists else error_code(r) for r in results]

    def batch_put_from(self, keys, buffer_ptrs, sizes, config=None):
        if self._store is None or not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        if not keys:
            return []
        if config is None:
            results = self._batch_put_from(keys, list(zip(buffer_ptrs, sizes)))
            return [OK if r is None or type(r) is _AlreadyExists else _failed(r, None) for r in results]
        return self._batch_from(keys, [[(p, s)] for p, s in zip(buffer_ptrs, sizes)], config, False)

    def batch_upsert_from(self, keys, buffer_ptrs, sizes, config=None):
        if self._store is None or not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        if not keys:
            return []
        return self._batch_from(keys, [[(p, s)] for p, s in zip(buffer_ptrs, sizes)], config, True)

    def batch_put_from_multi_buffers(self, keys, all_buffer_ptrs, all_sizes, config=None):
        """Object i gathered from its buffers in order; ``[]`` when not set up, as Mooncake's."""
        if self._store is None:
            return []
        sources = _scatter_lists(keys, all_buffer_ptrs, all_sizes)
        if sources is None:
            return [INVALID_PARAMS] * len(keys)
        return self._batch_from(keys, sources, config, False)

    # ---- reads ---------------------------------------------------------------------------------

    def get(self, key):
        """The object's bytes, or b"" on a miss or any failure."""
        try:
            return self._get(key)
        except _KvtideError as e:
            if isinstance(e, kvtide.InvalidArgument):
                _key(key)
            return b""

    def get_batch(self, keys):
        """bytes per key (b"" for a miss); ``[b""]`` for no keys, as Mooncake's."""
        if self._store is None or len(keys) == 0:
            return [b""]
        get = self.get
        return [get(k) for k in keys]

    def get_buffer(self, key):
        """A BufferHandle with the object's bytes (one atomic read), or None on a miss or an
        empty object."""
        try:
            data = self._get(key)
        except _KvtideError as e:
            if isinstance(e, kvtide.InvalidArgument):
                _key(key)
            return None
        return BufferHandle(data) if data else None

    def batch_get_buffer(self, keys):
        get_buffer = self.get_buffer
        return [get_buffer(k) for k in keys]

    def get_into(self, key, buffer_ptr, size):
        """The object's size, INVALID_PARAMS if ``size`` is smaller (nothing written),
        OBJECT_NOT_FOUND on a miss."""
        try:
            return self._get_into(key, (buffer_ptr, size))
        except _KvtideError as e:
            return _failed(e, key, ((buffer_ptr, "buffer_ptr"), (size, "size")))

    def batch_get_into(self, keys, buffer_ptrs, sizes):
        """Each object into the start of its buffer: its size, or a code per key."""
        if self._store is None or not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        if not keys:
            return []
        results = self._batch_get_into(keys, list(zip(buffer_ptrs, sizes)))
        return [r if type(r) is int else _failed(r, None) for r in results]

    def batch_get_into_multi_buffers(self, keys, all_buffer_ptrs, all_sizes, prefer_alloc_in_same_node=False):
        """Object i scattered in order across its buffers; their sizes must add up to at least
        the object's (INVALID_PARAMS for that key otherwise)."""
        lists = _scatter_lists(keys, all_buffer_ptrs, all_sizes)
        if self._store is None or lists is None:
            return [INVALID_PARAMS] * len(keys)
        results = self._store.batch_get_into_multi_buffers(keys, lists)
        # kvtide wants exact sizes; Mooncake fills the first bytes of larger lists.
        larger = [i for i, r in enumerate(results) if isinstance(r, kvtide.SizeMismatch)]
        if larger:
            sizes = self._store.batch_get_size([keys[i] for i in larger])
            again, where = [], []
            for i, size in zip(larger, sizes):
                if isinstance(size, BaseException):
                    # Gone (or failing) since the first read: that is its answer now.
                    results[i] = size
                    continue
                if size > sum(s for _, s in lists[i]):
                    continue
                again.append(_cut(lists[i], size))
                where.append(i)
            if where:
                for i, r in zip(where, self._store.batch_get_into_multi_buffers([keys[i] for i in where], again)):
                    # Resized again between the reads (an upsert in between): read it whole, once.
                    results[i] = self._scatter_whole(keys[i], lists[i], r) if isinstance(r, kvtide.SizeMismatch) else r
        return _ints(results)

    def _scatter_whole(self, key, buffers, mismatch):
        """The object read whole (``get`` is atomic) and copied in order across ``buffers``:
        its size, the read's error, or ``mismatch`` when it does not fit."""
        try:
            data = self._store.get(key)
        except kvtide.KvtideError as e:
            return e
        if len(data) > sum(n for _, n in buffers):
            return mismatch
        base = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
        at = 0
        for ptr, n in buffers:
            take = min(n, len(data) - at)
            if take <= 0:
                break
            ctypes.memmove(ptr, base + at, take)
            at += take
        return len(data)

    def get_into_ranges(self, buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes):
        """Byte ranges of objects into registered buffers, Mooncake's nested shape: per buffer
        ``b``, its keys ``all_keys[b]``; per key ``j`` its ranges ``all_dst_offsets[b][j][k]``,
        ``all_src_offsets[b][j][k]``, ``all_sizes[b][j][k]``. Returns the same nesting, one int
        per range: the bytes read, or a negative code. A buffer must lie in memory registered
        with ``register_buffer`` (or the local buffer, or a memory-pool allocation), whose end
        bounds its ranges. Mismatched list lengths, an unregistered buffer, or a range outside
        the buffer or the object answer INVALID_PARAMS for the ranges concerned; a miss answers
        OBJECT_NOT_FOUND; the other ranges are read."""
        results, buffers, fragments, places = self._ranges_plan(buffer_ptrs, all_keys, all_dst_offsets,
                                                                all_src_offsets, all_sizes)
        if not buffers:
            return results
        try:
            answers = self._store.get_into_ranges(buffers, fragments)
        except (_KvtideError, TypeError, OverflowError):
            self._ranges_type_errors(buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes)
            return results
        return _place_ranges(results, places, answers)

    def _ranges_plan(self, buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes):
        """``get_into_ranges``' arguments checked and flattened: the result nesting (every range
        INVALID_PARAMS until read), kvtide's buffers and fragments, and where each answer goes."""
        n = len(buffer_ptrs)
        # Mooncake's shape for errors: one row per key, one entry per destination offset.
        results = []
        for b in range(n):
            keys_b = all_keys[b] if b < len(all_keys) else [None]
            dst_b = all_dst_offsets[b] if b < len(all_dst_offsets) else []
            results.append([[INVALID_PARAMS] * (len(dst_b[j]) if j < len(dst_b) else 1) for j in range(len(keys_b))])
        buffers, fragments, places = [], [], []
        if self._store is None or not (n == len(all_keys) == len(all_dst_offsets) == len(all_src_offsets)
                                       == len(all_sizes)):
            return results, buffers, fragments, places
        for b, ptr in enumerate(buffer_ptrs):
            capacity = self._capacity(_uint(ptr, "buffer_ptrs"))
            keys, dst, src, sizes = all_keys[b], all_dst_offsets[b], all_src_offsets[b], all_sizes[b]
            if not ptr or not capacity or not (len(keys) == len(dst) == len(src) == len(sizes)):
                continue
            frags, where = [], []
            for j, key in enumerate(keys):
                if not (len(dst[j]) == len(src[j]) == len(sizes[j])):
                    continue
                for k in range(len(dst[j])):
                    frags.append((key, src[j][k], dst[j][k], sizes[j][k]))
                    where.append((j, k))
            if frags:
                buffers.append((ptr, capacity))
                fragments.append(frags)
                places.append((b, where))
        return results, buffers, fragments, places

    @staticmethod
    def _ranges_type_errors(buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes):
        """Mooncake's binding raises TypeError for arguments of the wrong type."""
        _uints(buffer_ptrs, "buffer_ptrs")
        for ks in all_keys:
            _keys(ks)
        for nested, what in ((all_dst_offsets, "all_dst_offsets"), (all_src_offsets, "all_src_offsets"),
                             (all_sizes, "all_sizes")):
            for per in nested:
                for r in per:
                    _uints(r, what)

    # ---- stream-bound reads (the calls Mooncake Store's stream-binding proposal names) ---------

    def batch_get_into_multi_buffers_on_stream(self, keys, all_buffer_ptrs, all_sizes, stream_ptr=0,
                                               prefer_alloc_in_same_node=False):
        """``batch_get_into_multi_buffers`` with the copies ordered on the caller's CUDA stream
        ``stream_ptr`` (a ``CUstream`` as an int, e.g. ``torch.cuda.Stream.cuda_stream``): when
        it returns, an event recorded on that stream is a valid "KV ready" signal for a compute
        stream or a captured graph, and the host never waits for the copies. The objects stay
        leased until the stream passed them. Returns a ``StreamReadHandle`` (its ``wait`` gives
        the per-key ints). ``stream_ptr`` 0 is the blocking call and returns its list. Unlike
        the blocking call, each key's sizes must add up to its object's size exactly (the
        copies are planned before they run): a larger list answers INVALID_PARAMS. A stream
        being captured into a graph answers TRANSFER_FAIL for every key, before anything is
        enqueued."""
        if _uint(stream_ptr, "stream_ptr") == 0:
            return self.batch_get_into_multi_buffers(keys, all_buffer_ptrs, all_sizes, prefer_alloc_in_same_node)
        lists = _scatter_lists(keys, all_buffer_ptrs, all_sizes)
        if self._store is None or lists is None:
            return StreamReadHandle.done([INVALID_PARAMS] * len(keys))
        try:
            ticket = self._store.batch_get_into_multi_buffers_on_stream(keys, lists, stream_ptr)
        except _KvtideError as e:
            return StreamReadHandle.done([error_code(e)] * len(keys))
        return StreamReadHandle(ticket, _ints)

    def get_into_ranges_on_stream(self, buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes,
                                  stream_ptr=0):
        """``get_into_ranges`` with the copies ordered on ``stream_ptr``, as
        ``batch_get_into_multi_buffers_on_stream``: a ``StreamReadHandle`` whose ``wait`` gives
        ``get_into_ranges``' nesting; 0 is the blocking call."""
        if _uint(stream_ptr, "stream_ptr") == 0:
            return self.get_into_ranges(buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes)
        results, buffers, fragments, places = self._ranges_plan(buffer_ptrs, all_keys, all_dst_offsets,
                                                                all_src_offsets, all_sizes)
        if not buffers:
            return StreamReadHandle.done(results)
        try:
            ticket = self._store.get_into_ranges_on_stream(buffers, fragments, stream_ptr)
        except (TypeError, OverflowError):
            self._ranges_type_errors(buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes)
            return StreamReadHandle.done(results)
        except _KvtideError as e:
            code = error_code(e)
            for b, where in places:
                for j, k in where:
                    results[b][j][k] = code
            return StreamReadHandle.done(results)
        # The ticket has one result per fragment, buffer after buffer: cut it back per buffer.
        counts = [len(f) for f in fragments]

        def shape(flat):
            answers, at = [], 0
            for c in counts:
                answers.append(flat[at:at + c])
                at += c
            return _place_ranges([[list(r) for r in row] for row in results], places, answers)

        return StreamReadHandle(ticket, shape)

    def batch_get_into_multi_buffers_step_on_stream(self, layer_keys, layer_buffer_ptrs, layer_sizes, stream_ptr,
                                                    events=None, flags=None):
        """Every layer of an inference step in one call (every lease request sent at once): per layer ``l``
        its keys, buffers and sizes as ``batch_get_into_multi_buffers_on_stream`` takes them,
        its copies enqueued on ``stream_ptr`` in layer order, each followed by its signal:
        ``events[l]`` recorded (a ``torch.cuda.Event`` or a ``CUevent``) or ``flags[l] = (ptr,
        value)`` written. Returns a ``StreamReadHandle`` whose ``wait`` gives one list of ints
        per layer. A bad step (list lengths, overlapping destinations, a bad signal, a
        capturing stream) answers a code for every key without enqueueing anything."""
        n = len(layer_keys)
        shape = [len(k) for k in layer_keys]
        failed = lambda code: StreamReadHandle.done([[code] * c for c in shape])  # noqa: E731
        if self._store is None or not (n == len(layer_buffer_ptrs) == len(layer_sizes)):
            return failed(INVALID_PARAMS)
        layers = []
        for keys, ptrs, sizes in zip(layer_keys, layer_buffer_ptrs, layer_sizes):
            lists = _scatter_lists(keys, ptrs, sizes)
            if lists is None:
                return failed(INVALID_PARAMS)
            layers.append((keys, lists))
        try:
            ticket = self._store.step_on_stream(layers, _uint(stream_ptr, "stream_ptr"), events=events, flags=flags)
        except _KvtideError as e:
            return failed(error_code(e))

        def per_layer(flat):
            codes, at = [], 0
            for c in shape:
                codes.append(_ints(flat[at:at + c]))
                at += c
            return codes

        return StreamReadHandle(ticket, per_layer)

    # ---- existence, size, removal -----------------------------------------------------------

    def is_exist(self, key):
        """1 present, 0 absent, a negative code on error."""
        try:
            return 1 if self._exists(key) else 0
        except _KvtideError as e:
            return _failed(e, key)

    def batch_is_exist(self, keys):
        if self._store is None:
            return [INVALID_PARAMS] * len(keys)
        return [(1 if r else 0) if type(r) is bool else error_code(r) for r in self._store.batch_exists(keys)]

    def get_size(self, key):
        """The object's size, or a negative code (OBJECT_NOT_FOUND on a miss)."""
        try:
            return self._get_size(key)
        except _KvtideError as e:
            return _failed(e, key)

    def remove(self, key, force=False):
        """0, OBJECT_NOT_FOUND, or OBJECT_HAS_LEASE while it is read or pinned (unless force)."""
        try:
            self._remove(key, force=force)
            return OK
        except _KvtideError as e:
            return _failed(e, key)

    def batch_remove(self, keys, force=False):
        if self._store is None:
            return [INVALID_PARAMS] * len(keys)
        return _ints(self._store.batch_remove(keys, force=force), ok=OK)

    def remove_by_regex(self, regex_pattern, force=False):
        """Removes the keys the pattern matches anywhere (``re.search``); the number removed,
        or INVALID_PARAMS for a bad pattern. Objects being read or pinned are skipped unless
        ``force``."""
        if self._store is None:
            return INVALID_PARAMS
        try:
            pattern = re.compile(regex_pattern)
        except re.error:
            return INVALID_PARAMS
        return self._remove_where(lambda k: pattern.search(k) is not None, force)

    def remove_all(self, force=False):
        """Removes every object; the number removed. Objects being read or pinned are skipped
        unless ``force``."""
        if self._store is None:
            return INVALID_PARAMS
        return self._remove_where(lambda k: True, force)

    def _remove_where(self, wanted, force):
        # A page of keys at a time, so memory stays bounded however many keys there are (a
        # removal does not move the cursor past keys not yet scanned).
        removed = 0
        cursor = 0
        try:
            while cursor is not None:
                page, cursor = self._store.scan_keys(None, cursor, _SCAN_PAGE)
                keys = [k for k in page if wanted(k.decode("utf-8", "surrogateescape"))]
                for r in self._store.batch_remove(keys, force=force) if keys else []:
                    if not isinstance(r, BaseException):
                        removed += 1
        except kvtide.KvtideError as e:
            return removed if removed else error_code(e)
        return removed

    # ---- buffer registration and client memory ----------------------------------------------

    def register_buffer(self, buffer_ptr, size):
        """Records the buffer: it bounds ``get_into_ranges`` ranges into it (kvtide reads and
        writes host memory without registration; GPU memory is registered by the transports
        as needed). 0, or INVALID_PARAMS (not set up, a null pointer)."""
        buffer_ptr = _uint(buffer_ptr, "buffer_ptr")
        size = _uint(size, "size")
        if self._store is None or buffer_ptr == 0:
            return INVALID_PARAMS
        with self._regions_lock:
            if buffer_ptr not in self._registered:
                bisect.insort(self._bases, buffer_ptr)
            self._registered[buffer_ptr] = size
        return OK

    def unregister_buffer(self, buffer_ptr):
        buffer_ptr = _uint(buffer_ptr, "buffer_ptr")
        with self._regions_lock:
            if self._store is None or self._registered.pop(buffer_ptr, None) is None:
                return INVALID_PARAMS
            self._bases.pop(bisect.bisect_left(self._bases, buffer_ptr))
        return OK

    def _capacity(self, ptr):
        """Bytes from ``ptr`` to the end of the registered region holding it (0: none)."""
        with self._regions_lock:
            return self._capacity_locked(ptr)

    def _capacity_locked(self, ptr):
        i = bisect.bisect_right(self._bases, ptr)
        if i:
            base = self._bases[i - 1]
            if ptr < base + self._registered[base]:
                return base + self._registered[base] - ptr
        # Overlapping registrations: any other region holding it (as Mooncake's scan).
        for base, size in self._registered.items():
            if base <= ptr < base + size:
                return base + size - ptr
        for region in [self._local.region] if self._local is not None else []:
            if region.base <= ptr < region.base + region.size:
                return region.base + region.size - ptr
        for base, region in self._pool_regions.items():
            if base <= ptr < base + region.size:
                return base + region.size - ptr
        return 0

    def _local_allocator(self):
        """The store's local buffer (``local_buffer_size`` bytes), made on first use."""
        with self._local_lock:
            if self._local is None and self._store is not None and self._local_buffer_size:
                self._local = _RangeAllocator(_Region(self._local_buffer_size))
            return self._local

    def alloc_from_mem_pool(self, size):
        """Host memory for zero-copy calls, as Mooncake's dummy (``setup_dummy``) client
        allocates from its shared memory: the address, valid until ``close``, or 0 (a client set
        up with ``setup``, as Mooncake's real client answers; or ``mem_pool_size`` used up)."""
        size = _uint(size, "size")
        with self._regions_lock:
            if self._store is None or not self._dummy or size == 0 or self._pool_bytes + size > self._pool_limit:
                return 0
            self._pool_bytes += size
        try:
            region = _Region(size)
        except (OSError, ValueError, OverflowError):
            with self._regions_lock:
                self._pool_bytes -= size
            return 0
        with self._regions_lock:
            self._pool_regions[region.base] = region
        return region.base

    # ---- tensors (torch), in Mooncake's object layout --------------------------------------------

    def _write_tensors(self, keys, infos, upsert, config=None):
        """Per key, 0 or a code: each valid tensor as [metadata][bytes], in one batch."""
        results = [INVALID_PARAMS] * len(keys)
        todo, sources = [], []
        for i, info in enumerate(infos):
            if info is not None:
                todo.append(i)
                sources.append([info[0], info[1]] if info[2] else [info[0]])
        if todo:
            done = self._batch_from([keys[i] for i in todo], sources, config, upsert)
            for i, r in zip(todo, done):
                results[i] = r
        return results

    def put_tensor(self, key, tensor):
        """Stores the tensor (CPU or CUDA, copied as contiguous) in Mooncake's tensor layout."""
        if self._store is None:
            return INVALID_PARAMS
        return self._write_tensors([key], [_tensor_source(tensor)], False)[0]

    def upsert_tensor(self, key, tensor):
        if self._store is None:
            return INVALID_PARAMS
        return self._write_tensors([key], [_tensor_source(tensor)], True)[0]

    def batch_put_tensor(self, keys, tensors_list):
        return self._batch_tensors(keys, tensors_list, False)

    def batch_upsert_tensor(self, keys, tensors_list):
        return self._batch_tensors(keys, tensors_list, True)

    def _batch_tensors(self, keys, tensors_list, upsert):
        keys = _keys(keys)
        tensors_list = list(tensors_list)
        if self._store is None or len(keys) != len(tensors_list) or not keys:
            return [INVALID_PARAMS] * len(keys)
        return self._write_tensors(keys, [_tensor_source(t) for t in tensors_list], upsert)

    def get_tensor(self, key):
        """The tensor (CPU), or None on a miss or a value that is not a tensor object."""
        try:
            raw = self._get(key)
        except _KvtideError:
            return None
        return _tensor_from_bytes(raw)

    def batch_get_tensor(self, keys):
        if self._store is None:
            return [None] * len(keys)
        get_tensor = self.get_tensor
        return [get_tensor(k) for k in keys]

    def put_tensor_with_tp(self, key, tensor, tp_rank=0, tp_size=1, split_dim=0):
        """Stores all ``tp_size`` shards of ``tensor`` (split evenly along ``split_dim``; an
        uneven split is INVALID_PARAMS, as Mooncake's) as ``{key}_tp_{rank}``, each a shard
        object that records the full shape; the first failing shard's code, else 0."""
        if self._store is None:
            return INVALID_PARAMS
        if tp_size <= 1:
            return self.put_tensor(key, tensor)
        shards = _tp_shards(tensor, tp_size, split_dim)
        if shards is None:
            return INVALID_PARAMS
        for code in self._write_tensors([f"{key}_tp_{r}" for r in range(tp_size)], shards, False):
            if code != OK:
                return code
        return OK

    def batch_put_tensor_with_tp(self, base_keys, tensors_list, tp_rank=0, tp_size=1, split_dim=0):
        if tp_size <= 1:
            return self.batch_put_tensor(base_keys, tensors_list)
        base_keys = _keys(base_keys)
        tensors_list = list(tensors_list)
        if self._store is None or len(base_keys) != len(tensors_list) or not base_keys:
            return [INVALID_PARAMS] * len(base_keys)
        return self._put_tp_batch(base_keys, tensors_list, tp_size, split_dim)

    def _put_tp_batch(self, base_keys, tensors, tp_size, split_dim, config=None):
        results = [INVALID_PARAMS] * len(base_keys)
        if config is not None:
            # Group ids name base keys; every shard of a key is in its key's group.
            code = _config_code(config, len(base_keys))
            if code:
                return [code] * len(base_keys)
            config = _without_groups(config)
        keys, infos, owners = [], [], []
        for i, (key, tensor) in enumerate(zip(base_keys, tensors)):
            shards = None if tensor is None else _tp_shards(tensor, tp_size, split_dim)
            if shards is None:
                continue
            owners.append(i)
            keys += [f"{key}_tp_{r}" for r in range(tp_size)]
            infos += shards
        if keys:
            codes = self._write_tensors(keys, infos, False, config)
            for n, i in enumerate(owners):
                failed = [c for c in codes[n * tp_size:(n + 1) * tp_size] if c != OK]
                results[i] = failed[0] if failed else OK
        return results

    # The pub_tensor family: the tensor writes with a ReplicateConfig, validated as Mooncake
    # validates it (preferred_segments one per replica, then the write checks of put).

    def _pub_code(self, config):
        if self._store is None:
            return INVALID_PARAMS
        if not isinstance(config, ReplicateConfig):
            raise TypeError(f"config must be a ReplicateConfig, got {type(config).__name__}")
        if config._preferred_segments and len(config._preferred_segments) != config._replica_num:
            return INVALID_PARAMS
        return OK

    def pub_tensor(self, key, tensor, config=None):
        config = ReplicateConfig() if config is None else config
        return self._pub_code(config) or self._write_tensors([key], [_tensor_source(tensor)], False, config)[0]

    def upsert_pub_tensor(self, key, tensor, config=None):
        config = ReplicateConfig() if config is None else config
        return self._pub_code(config) or self._write_tensors([key], [_tensor_source(tensor)], True, config)[0]

    def _batch_pub(self, keys, tensors_list, config, upsert):
        config = ReplicateConfig() if config is None else config
        keys = _keys(keys)
        tensors_list = list(tensors_list)
        if self._store is None or len(keys) != len(tensors_list) or not keys or self._pub_code(config):
            return [INVALID_PARAMS] * len(keys)
        return self._write_tensors(keys, [_tensor_source(t) for t in tensors_list], upsert, config)

    def batch_pub_tensor(self, keys, tensors_list, config=None):
        return self._batch_pub(keys, tensors_list, config, False)

    def batch_upsert_pub_tensor(self, keys, tensors_list, config=None):
        return self._batch_pub(keys, tensors_list, config, True)

    def pub_tensor_with_tp(self, key, tensor, config=None, tp_rank=0, tp_size=1, split_dim=0):
        config = ReplicateConfig() if config is None else config
        code = self._pub_code(config)
        if code:
            return code
        if tp_size <= 1:
            return self.pub_tensor(key, tensor, config)
        shards = _tp_shards(tensor, tp_size, split_dim)
        if shards is None:
            return INVALID_PARAMS
        code = _config_code(config)
        if code:
            return code
        config = _without_groups(config)
        for code in self._write_tensors([f"{key}_tp_{r}" for r in range(tp_size)], shards, False, config):
            if code != OK:
                return code
        return OK

    def batch_pub_tensor_with_tp(self, base_keys, tensors_list, config=None, tp_rank=0, tp_size=1, split_dim=0):
        config = ReplicateConfig() if config is None else config
        if tp_size <= 1:
            return self.batch_pub_tensor(base_keys, tensors_list, config)
        base_keys = _keys(base_keys)
        tensors_list = list(tensors_list)
        if self._store is None or len(base_keys) != len(tensors_list) or not base_keys or self._pub_code(config):
            return [INVALID_PARAMS] * len(base_keys)
        return self._put_tp_batch(base_keys, tensors_list, tp_size, split_dim, config)

    def save_tensor_to_safetensor(self, key, file_name=None):
        """The tensor at ``key`` written to a safetensors file (named ``key`` unless given): 0,
        FILE_NOT_FOUND (-1100) when there is no tensor, INVALID_PARAMS when the file cannot be
        written. Needs the ``safetensors`` package."""
        if self._store is None:
            return INVALID_PARAMS
        tensor = self.get_tensor(key)
        if tensor is None:
            return FILE_NOT_FOUND
        try:
            from safetensors.torch import save_file

            save_file({key: tensor}, key if file_name is None else file_name)
        except Exception:
            return INVALID_PARAMS
        return OK

    def load_tensor_from_safetensor(self, key=None, file_name=None):
        """Stores a tensor of a safetensors file under ``key`` (default: the file name): the
        entry named ``key``, else the file's first. The tensor, or None on any failure."""
        if file_name is None:
            raise TypeError("load_tensor_from_safetensor() needs file_name")
        if self._store is None:
            return None
        try:
            from safetensors.torch import load_file

            loaded = load_file(file_name)
        except Exception:
            return None
        if not loaded:
            return None
        target = file_name if key is None else key
        tensor = loaded[target] if key is not None and target in loaded else next(iter(loaded.values()))
        return tensor if self.put_tensor(target, tensor) == OK else None

    def get_tensor_with_tp(self, key, tp_rank=0, tp_size=1, split_dim=0):
        return self.get_tensor(key if tp_size <= 1 else f"{key}_tp_{tp_rank}")

    def batch_get_tensor_with_tp(self, base_keys, tp_rank=0, tp_size=1):
        keys = base_keys if tp_size <= 1 else [f"{k}_tp_{tp_rank}" for k in base_keys]
        return self.batch_get_tensor(keys)

    def get_tensor_into(self, key, buffer_ptr, size):
        """The tensor as a view over ``[buffer_ptr, +size)`` (which receives the whole stored
        object, metadata then bytes), or None."""
        if self._store is None or buffer_ptr == 0:
            return None
        n = self.get_into(key, buffer_ptr, size)
        return _tensor_view(buffer_ptr, n) if n >= 0 else None

    def batch_get_tensor_into(self, keys, buffer_ptrs, sizes):
        """Per key a tensor view or None; INVALID_PARAMS per key (ints) for mismatched lists,
        a null pointer, or a store not set up, as Mooncake's."""
        if (self._store is None or not (len(keys) == len(buffer_ptrs) == len(sizes))
                or any(p == 0 for p in buffer_ptrs)):
            return [INVALID_PARAMS] * len(keys)
        got = self.batch_get_into(keys, buffer_ptrs, sizes)
        return [_tensor_view(p, n) if n >= 0 else None for p, n in zip(buffer_ptrs, got)]

    def get_tensor_with_tp_into(self, key, buffer_ptr, size, tp_rank=0, tp_size=1, split_dim=0):
        if self._store is None:
            return None
        return self.get_tensor_into(key if tp_size <= 1 else f"{key}_tp_{tp_rank}", buffer_ptr, size)

    def batch_get_tensor_with_tp_into(self, base_keys, buffer_ptrs, sizes, tp_rank=0, tp_size=1):
        if self._store is None:
            return [None] * len(base_keys)
        keys = base_keys if tp_size <= 1 else [f"{k}_tp_{tp_rank}" for k in base_keys]
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    def _tensor_from_check(self, buffer_ptr, size):
        """INVALID_PARAMS unless ``[buffer_ptr, +size)`` holds a valid tensor object."""
        buffer_ptr, size = _uint(buffer_ptr, "buffer_ptr"), _uint(size, "size")
        if buffer_ptr == 0 or self._store is None or size < TENSOR_METADATA_SIZE:
            return INVALID_PARAMS
        return OK if _parse_metadata(_view(buffer_ptr, TENSOR_METADATA_SIZE), size) is not None else INVALID_PARAMS

    def put_tensor_from(self, key, buffer_ptr, size):
        """Stores ``[buffer_ptr, +size)``, which must hold a whole tensor object (Mooncake's
        metadata then the bytes, as ``get_tensor_into`` leaves it); INVALID_PARAMS otherwise."""
        code = self._tensor_from_check(buffer_ptr, size)
        return code if code else self.put_from(key, buffer_ptr, size)

    def upsert_tensor_from(self, key, buffer_ptr, size):
        code = self._tensor_from_check(buffer_ptr, size)
        return code if code else self.upsert_from(key, buffer_ptr, size)

    def _batch_tensor_from(self, keys, buffer_ptrs, sizes, upsert):
        if self._store is None:
            return [INVALID_PARAMS] * len(keys)
        if not keys:
            return []
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        # One bad buffer fails the batch, as Mooncake's checks all before writing any.
        if any(self._tensor_from_check(p, s) for p, s in zip(buffer_ptrs, sizes)):
            return [INVALID_PARAMS] * len(keys)
        if upsert:
            return self.batch_upsert_from(keys, buffer_ptrs, sizes)
        return self.batch_put_from(keys, buffer_ptrs, sizes)

    def batch_put_tensor_from(self, keys, buffer_ptrs, sizes):
        return self._batch_tensor_from(keys, buffer_ptrs, sizes, False)

    def batch_upsert_tensor_from(self, keys, buffer_ptrs, sizes):
        return self._batch_tensor_from(keys, buffer_ptrs, sizes, True)

    def put_tensor_with_tp_from(self, key, buffer_ptr, size, tp_rank=0, tp_size=1, split_dim=0):
        """The full tensor object in ``[buffer_ptr, +size)`` stored as ``tp_size`` shards, as
        ``put_tensor_with_tp``."""
        buffer_ptr, size = _uint(buffer_ptr, "buffer_ptr"), _uint(size, "size")
        if self._store is None or buffer_ptr == 0 or size < TENSOR_METADATA_SIZE:
            return INVALID_PARAMS
        if tp_size <= 1:
            return self.put_tensor_from(key, buffer_ptr, size)
        tensor = _tensor_view(buffer_ptr, size)
        if tensor is None:
            return INVALID_PARAMS
        return self.put_tensor_with_tp(key, tensor, tp_rank, tp_size, split_dim)

    def batch_put_tensor_with_tp_from(self, base_keys, buffer_ptrs, sizes, tp_rank=0, tp_size=1, split_dim=0):
        if self._store is None:
            return [INVALID_PARAMS] * len(base_keys)
        if tp_size <= 1:
            return self.batch_put_tensor_from(base_keys, buffer_ptrs, sizes)
        if not (len(base_keys) == len(buffer_ptrs) == len(sizes)) or not base_keys:
            return [INVALID_PARAMS] * len(base_keys)
        tensors = []
        for p, s in zip(buffer_ptrs, sizes):
            p, s = _uint(p, "buffer_ptrs"), _uint(s, "sizes")
            tensors.append(_tensor_view(p, s) if p and s >= TENSOR_METADATA_SIZE else None)
        return self._put_tp_batch(_keys(base_keys), tensors, tp_size, split_dim)


def _parse_size(text, default):
    """A size as Mooncake's config dict reads it: bytes, or a number with K/KB/M/MB/G/GB/T/TB/B
    (binary units, any case, optional space), or "infinite"; the default when absent; None
    when it does not read as one ("50%")."""
    if text is None:
        return default
    s = text.strip()
    if s == "infinite":
        return _U64 - 1
    m = re.fullmatch(r"([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)", s)
    if not m:
        return None
    value = float(m.group(1))
    scale = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30,
             "GB": 1 << 30, "T": 1 << 40, "TB": 1 << 40}.get(m.group(2).upper())
    if scale is None or value < 0 or value * scale >= _U64:
        return None
    return int(value * scale)


def _parse_bool(text, default):
    if text is None:
        return default
    return {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False,
            "off": False}.get(text.strip().lower(), default)


def _place_ranges(results, places, answers):
    """Puts kvtide's per-buffer fragment answers into ``get_into_ranges``' nesting."""
    for (b, where), got in zip(places, answers):
        row = results[b]
        for (j, k), r in zip(where, got):
            row[j][k] = r if type(r) is int else error_code(r)
    return results


class StreamReadHandle:
    """A stream-bound read (``*_on_stream`` with a stream): the copies are already ordered on
    the caller's stream; this says how they went once kvtide saw the stream pass them, and holds
    the read's objects leased until then. Dropping it neither blocks nor cancels anything."""

    def __init__(self, ticket, shape):
        self._ticket = ticket
        self._shape = shape
        self._final = None

    @classmethod
    def done(cls, results):
        """A handle of a read that enqueued nothing: ``results`` are its answer."""
        handle = cls(None, None)
        handle._final = results
        return handle

    def is_done(self):
        """True once the stream passed the copies (``wait`` returns at once)."""
        return self._final is not None or self._ticket.status() != "pending"

    def wait(self, timeout_ms=60_000):
        """Blocks the host until the stream passed the copies (at most ``timeout_ms``): the
        per-key (or per-range) ints, or None if the time passed first. Device-side callers wait
        on an event recorded on the stream instead."""
        if self._final is None:
            got = self._ticket.wait(timeout_ms)
            if got is None:
                return None
            self._final = self._shape(got)
        return self._final

    def keys_pinned(self):
        """Objects this read holds leased now (0 once the stream passed the copies)."""
        return 0 if self._ticket is None else self._ticket.keys_pinned()


def _scatter_lists(keys, all_buffer_ptrs, all_sizes):
    """Per key, its list of (ptr, size) buffers; None when the lists' lengths do not match."""
    if not (len(keys) == len(all_buffer_ptrs) == len(all_sizes)):
        return None
    lists = []
    for ptrs, sizes in zip(all_buffer_ptrs, all_sizes):
        if len(ptrs) != len(sizes):
            return None
        lists.append(list(zip(_uints(ptrs, "all_buffer_ptrs"), _uints(sizes, "all_sizes"))))
    return lists


def _cut(buffers, size):
    """The first ``size`` bytes of a list of (ptr, len) buffers."""
    out, left = [], size
    for ptr, n in buffers:
        if left == 0:
            break
        take = min(n, left)
        out.append((ptr, take))
        left -= take
    return out


def _view(ptr, n):
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")


# ---- Mooncake's tensor object layout -----------------------------------------------------------
#
# An object is a TensorMetadata (integration_utils.h) then the tensor's bytes: a 40-byte header
# (magic "NOOM" 0x4d4f4f4e, version 1, header size 304, dtype, ndim, layout kind FULL/SHARD,
# flags, data offset, data bytes) and a 264-byte layout (global and local shape, 8 dims each, -1
# past ndim; up to 4 parallel axes). Native little-endian, as Mooncake writes it on x86 and ARM.

_HEADER = struct.Struct("<IHHiiIIQQ")
_LAYOUT = struct.Struct("<8q8qII" + "iiiiiiq" * 4)
TENSOR_METADATA_SIZE = _HEADER.size + _LAYOUT.size  # 304
_MAGIC = 0x4D4F4F4E
_VERSION = 1
_MAX_DIMS = 8
_MAX_AXES = 4
_FULL, _SHARD = 0, 1
_AXIS_TP = 1

# Mooncake's TensorDtype numbering and element sizes.
_DTYPE_NAMES = ["float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                "bool", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
_DTYPE_SIZES = [4, 8, 1, 1, 2, 2, 4, 4, 8, 8, 1, 2, 2, 1, 1]


@functools.lru_cache(maxsize=None)
def _dtype_tables():
    import torch

    to_torch = [getattr(torch, name, None) for name in _DTYPE_NAMES]
    return to_torch, {dt: i for i, dt in enumerate(to_torch) if dt is not None}


def _metadata(dtype_index, global_shape, local_shape, data_bytes, kind=_FULL, axes=()):
    ndim = len(global_shape)
    dims = lambda shape: list(shape) + [-1] * (_MAX_DIMS - len(shape))  # noqa: E731
    axis_fields = []
    for axis in axes:
        axis_fields += list(axis)
    axis_fields += [0] * (7 * (_MAX_AXES - len(axes)))
    return (_HEADER.pack(_MAGIC, _VERSION, TENSOR_METADATA_SIZE, dtype_index, ndim, kind, 0, TENSOR_METADATA_SIZE,
                         data_bytes)
            + _LAYOUT.pack(*dims(global_shape), *dims(local_shape), len(axes), 0, *axis_fields))


def _parse_metadata(head, total):
    """(dtype index, local shape, data offset, data bytes) of an object of ``total`` bytes whose
    first 304 bytes are ``head``, or None unless it passes every check of Mooncake's
    ValidateTensorMetadata (a stored value is outside input, never trusted)."""
    if total < TENSOR_METADATA_SIZE or len(head) < TENSOR_METADATA_SIZE:
        return None
    magic, version, header_size, dtype, ndim, kind, _flags, offset, nbytes = _HEADER.unpack_from(head, 0)
    layout = _LAYOUT.unpack_from(head, _HEADER.size)
    if (magic != _MAGIC or version != _VERSION or header_size != TENSOR_METADATA_SIZE
            or not 0 <= dtype < len(_DTYPE_NAMES) or not 0 <= ndim <= _MAX_DIMS or kind > _SHARD):
        return None
    global_shape, local_shape, axis_count = layout[0:8], layout[8:16], layout[16]
    if axis_count > _MAX_AXES or not TENSOR_METADATA_SIZE <= offset <= total or nbytes != total - offset:
        return None
    if any(d < 0 for d in global_shape[:ndim] + local_shape[:ndim]):
        return None
    if any(d != -1 for d in global_shape[ndim:] + local_shape[ndim:]):
        return None
    count = 1
    for d in local_shape[:ndim]:
        count *= d
    if count * _DTYPE_SIZES[dtype] != nbytes:
        return None
    for a in range(axis_count):
        kind_a, _index, rank, shards, split, _r0, _r1 = layout[18 + 7 * a:25 + 7 * a]
        if not 0 <= kind_a <= 4 or shards <= 0 or not 0 <= rank < shards or not -1 <= split < ndim:
            return None
    return dtype, list(local_shape[:ndim]), offset, nbytes


def _tensor_info(tensor):
    """(contiguous tensor, dtype index, shape, nbytes), or None for what Mooncake cannot store
    (not a torch tensor, an unsupported dtype, more than 8 dims)."""
    if "Tensor" not in type(tensor).__name__ or not hasattr(tensor, "dtype"):
        return None
    _, index_of = _dtype_tables()
    dtype_index = index_of.get(tensor.dtype)
    if dtype_index is None or tensor.dim() > _MAX_DIMS:
        return None
    t = tensor.detach().contiguous()
    return t, dtype_index, list(t.shape), t.numel() * t.element_size()


def _tensor_source(tensor, global_shape=None, axes=()):
    """(metadata bytes, data buffer, nbytes) to store ``tensor`` as one object; None for an
    unsupported one. CUDA tensors are copied to host first (on the current stream, waited for)."""
    info = _tensor_info(tensor)
    if info is None:
        return None
    t, dtype_index, shape, nbytes = info
    if t.device.type != "cpu":
        t = t.cpu()
    kind = _SHARD if axes else _FULL
    head = _metadata(dtype_index, shape if global_shape is None else global_shape, shape, nbytes, kind, axes)
    import torch

    return head, (t.view(-1).view(torch.uint8) if nbytes else None), nbytes


def _tp_shards(tensor, tp_size, split_dim):
    """The ``tp_size`` even shards of ``tensor`` along ``split_dim`` as tensor sources (each a
    SHARD object recording the full shape and its TP axis), or None (Mooncake's checks)."""
    info = _tensor_info(tensor)
    if info is None:
        return None
    t, _, shape, _ = info
    if not 0 <= split_dim < len(shape) or tp_size <= 0 or shape[split_dim] % tp_size:
        return None
    step = shape[split_dim] // tp_size
    return [_tensor_source(t.narrow(split_dim, r * step, step), shape, [(_AXIS_TP, 0, r, tp_size, split_dim, 0, step)])
            for r in range(tp_size)]


def _tensor_from_bytes(raw):
    parsed = _parse_metadata(raw, len(raw))
    if parsed is None:
        return None
    import torch

    dtype_index, shape, offset, nbytes = parsed
    dt = _dtype_tables()[0][dtype_index]
    if dt is None:
        return None
    if nbytes == 0:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(memoryview(raw)[offset:]), dtype=dt).reshape(shape)


def _tensor_view(ptr, n):
    """The tensor in the object at ``[ptr, +n)``, as a view of that memory (no copy), or None."""
    if n < TENSOR_METADATA_SIZE or not ptr:
        return None
    parsed = _parse_metadata(_view(ptr, TENSOR_METADATA_SIZE), n)
    if parsed is None:
        return None
    import torch

    dtype_index, shape, offset, nbytes = parsed
    dt = _dtype_tables()[0][dtype_index]
    if dt is None:
        return None
    if nbytes == 0:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr + offset), dtype=dt).reshape(shape)


def _serialize_tensor(tensor):
    """Mooncake's ``store._serialize_tensor``: (metadata bytes, data pointer, data bytes, the
    contiguous tensor owning the data) for writing a tensor object yourself; ValueError for an
    unsupported tensor."""
    info = _tensor_info(tensor)
    if info is None:
        raise ValueError("unsupported tensor for Mooncake tensor serialization")
    t, dtype_index, shape, nbytes = info
    return _metadata(dtype_index, shape, shape, nbytes), t.data_ptr(), nbytes, t


def _tensor_metadata_size():
    """Mooncake's ``store._tensor_metadata_size``: 304."""
    return TENSOR_METADATA_SIZE


def _deserialize_tensor(payload):
    """Mooncake's ``store._deserialize_tensor``: the tensor in a whole object's bytes;
    ValueError when they are not one."""
    tensor = _tensor_from_bytes(bytes(payload))
    if tensor is None:
        raise ValueError("invalid serialized Mooncake tensor payload")
    return tensor


# ---- BufferPool --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _lease_bytes_type(n):
    # A subclass so each exported array can hold its lease (the view keeps the lease alive, as
    # Mooncake's view holds a reference to its lease) and be weakly referenced by it.
    return type("LeaseBytes", (ctypes.c_ubyte * n,), {})


class BufferLease:
    """A buffer from a BufferPool: ``ptr``, ``size``, ``buffer`` (a writable memoryview of
    ``size`` bytes), ``release()``; a context manager. Released when dropped; ``release()``
    refuses while views from ``buffer`` are alive."""

    def __init__(self, pool, ptr, size, region_bytes, overflow):
        self._pool = pool
        self._ptr = ptr
        self._size = size
        self._region_bytes = region_bytes
        self._overflow = overflow
        self._views = []

    @property
    def ptr(self):
        if self._pool is None:
            raise RuntimeError("buffer lease is closed")
        return self._ptr

    @property
    def size(self):
        return self._size

    @property
    def buffer(self):
        if self._pool is None:
            raise RuntimeError("buffer lease is closed")
        arr = _lease_bytes_type(self._size).from_address(self._ptr)
        arr.lease = self
        self._views = [w for w in self._views if w() is not None]
        self._views.append(weakref.ref(arr))
        return memoryview(arr).cast("B")

    def release(self):
        if self._pool is None:
            return
        if any(w() is not None for w in self._views):
            raise RuntimeError("cannot release buffer while exported views exist")
        pool, self._pool = self._pool, None
        pool._release(self._ptr, self._region_bytes, self._overflow)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False

    def __del__(self):
        # No view can be alive here (each holds this lease), so the region is free to reuse.
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            try:
                pool._release(self._ptr, self._region_bytes, self._overflow)
            except Exception:
                pass


class BufferPool:
    """Mooncake's BufferPool: leases of host memory for zero-copy calls, carved from the store's
    local buffer (``local_buffer_size`` at setup) and, once that is full, from separately
    allocated overflow regions registered with the store. At most ``max_bytes`` leased at once
    (default twice the local buffer, never less than it) and at most ``max_regions`` leases;
    ``acquire`` blocks for room (``block``/``timeout``) or raises RuntimeError."""

    def __init__(self, store, max_bytes=0, min_size_class=64 * 1024, max_size_class=None, alignment=8 * 1024 * 1024,
                 block_on_exhaustion=True, default_timeout=None, max_regions=None, prewarm_size=None, prewarm_count=0):
        if not isinstance(store, MooncakeDistributedStore):
            raise RuntimeError("BufferPool store parameter must be a MooncakeDistributedStore")
        if store._store is None:
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        max_bytes, min_size_class, alignment = (_uint(max_bytes, "max_bytes"), _uint(min_size_class, "min_size_class"),
                                                _uint(alignment, "alignment"))
        if min_size_class == 0 or alignment == 0:
            raise RuntimeError("min_size_class and alignment must be positive")
        if alignment < ctypes.sizeof(ctypes.c_void_p) or alignment & (alignment - 1):
            raise RuntimeError("alignment must be a power of two and at least sizeof(void*)")
        local = store._local_allocator()
        if local is None:
            raise RuntimeError("BufferPool requires a store configured with a local buffer")
        capacity = local.region.size
        self._store = store
        self._local = local
        self._max_bytes = 2 * capacity if max_bytes == 0 else max(max_bytes, capacity)
        self._max_size_class = self._max_bytes if max_size_class is None else _uint(max_size_class, "max_size_class")
        self._alignment = alignment
        self._block = bool(block_on_exhaustion)
        self._timeout = None if default_timeout is None else float(default_timeout)
        self._max_regions = None if max_regions is None else _uint(max_regions, "max_regions")
        self._cond = threading.Condition()
        self._in_use = {}  # ptr -> (bytes, overflow region or None)
        self._total = 0
        self._reserving = 0
        self._closed = False
        self.acquire_count = 0
        self.overflow_count = 0
        self.wait_count = 0
        self.release_count = 0

    def _room_for(self, need):
        return (self._total + need <= self._max_bytes
                and (self._max_regions is None or len(self._in_use) + self._reserving < self._max_regions))

    def acquire(self, size, block=None, timeout=None):
        size = _uint(size, "size")
        should_block = self._block if block is None else bool(block)
        wait_s = self._timeout if timeout is None else float(timeout)
        if wait_s is not None and wait_s < 0:
            raise RuntimeError("timeout must be non-negative")
        need = max(size, 1)
        if need > self._max_bytes:
            raise RuntimeError("requested buffer size exceeds pool capacity")
        with self._cond:
            deadline = None
            while True:
                if self._closed:
                    raise RuntimeError("buffer pool is closed")
                if self._room_for(need):
                    break
                if not should_block:
                    raise RuntimeError("buffer pool is exhausted")
                self.wait_count += 1
                if wait_s is None:
                    self._cond.wait()
                    continue
                deadline = deadline if deadline is not None else time.monotonic() + wait_s
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError("timed out waiting for buffer")
                self._cond.wait(left)
            # Reserved before allocating (outside the lock), so concurrent acquires never
            # exceed the bounds.
            self._total += need
            self._reserving += 1
        try:
            ptr, overflow = self._allocate(need)
        except BaseException:
            with self._cond:
                self._total -= need
                self._reserving -= 1
                self._cond.notify_all()
            raise
        with self._cond:
            self._reserving -= 1
            self._in_use[ptr] = (need, overflow)
            self.acquire_count += 1
            self._cond.notify_all()
        return BufferLease(self, ptr, size, need, overflow)

    buffer = acquire

    def _allocate(self, need):
        ptr = self._local.allocate(need)
        if ptr is not None:
            return ptr, None
        region = _Region(need, self._alignment)
        if self._store.register_buffer(region.base, need) != OK:
            raise RuntimeError("overflow buffer registration failed")
        self.overflow_count += 1
        return region.base, region

    def _release(self, ptr, need, overflow):
        with self._cond:
            if ptr not in self._in_use:
                raise RuntimeError("buffer lease is not active")
            del self._in_use[ptr]
            self._total -= need
            self.release_count += 1
        if overflow is None:
            self._local.free(ptr)
        else:
            self._store.unregister_buffer(ptr)
        with self._cond:
            self._cond.notify_all()

    def prewarm(self, size, count):
        """Accepted for compatibility; regions are made on demand (as Mooncake's)."""
        _uint(size, "size"), _uint(count, "count")

    def close(self):
        with self._cond:
            if self._closed:
                return
            while self._reserving:
                self._cond.wait()
            if self._in_use:
                raise RuntimeError("cannot close buffer pool with active leases")
            self._closed = True
            self._cond.notify_all()

    def stats(self):
        """Leases held and bytes leased now, and the counters (kvtide's addition)."""
        with self._cond:
            return {"leases": len(self._in_use), "bytes": self._total, "max_bytes": self._max_bytes,
                    "acquire_count": self.acquire_count, "overflow_count": self.overflow_count,
                    "wait_count": self.wait_count, "release_count": self.release_count}


RegisteredBufferPool = BufferPool
RegisteredBufferLease = BufferLease

__all__ = [
    "MooncakeDistributedStore", "ReplicateConfig", "SoftPinAction", "ObjectDataType", "BufferHandle", "BufferPool",
    "BufferLease", "RegisteredBufferPool", "RegisteredBufferLease", "error_code", "TENSOR_METADATA_SIZE",
    "MAX_SOFT_PIN_TTL_MS", "OK", "INTERNAL_ERROR", "NO_AVAILABLE_HANDLE", "INVALID_PARAMS", "ILLEGAL_CLIENT",
    "REPLICA_IS_NOT_READY", "OBJECT_NOT_FOUND", "OBJECT_ALREADY_EXISTS", "OBJECT_HAS_LEASE", "LEASE_EXPIRED",
    "TRANSFER_FAIL", "CHECKSUM_MISMATCH", "RPC_FAIL", "RPC_TIMEOUT", "NOT_SUPPORTED", "FILE_NOT_FOUND",
    "DFS_SERVICE_UNAVAILABLE",
]
