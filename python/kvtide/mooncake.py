"""Mooncake Store's Python API on kvtide.

``MooncakeDistributedStore`` keeps the method names, signatures and return conventions of
``mooncake.store.MooncakeDistributedStore`` (Mooncake commit 3b5a5941, 2026-08-22; the same
core API as v0.3.12.post1): methods return ``0`` or a byte count on success and a negative
Mooncake ``ErrorCode`` on failure instead of raising; ``get`` returns ``b""`` on a miss;
``is_exist`` returns 1, 0 or a negative code; ``put`` of an existing key returns 0 and keeps
the old value (use ``upsert``). Code written against Mooncake switches by changing the import::

    from kvtide.mooncake import MooncakeDistributedStore

``setup``'s ``master_server_addr`` picks the store: ``"embedded"`` (or ``""``) opens kvtide
embedded in this process with ``global_segment_size`` bytes of DRAM (and an SSD tier in
``ssd_offload_path`` when ``enable_ssd_offload``); anything else is a ``kvtide-owner`` address
(``"unix:/run/kvtide/owner.sock"``, a socket path, or ``"host:port"``; ``KVTIDE_TOKEN_FILE``
gives a TCP owner's token), or a kvtide cluster, ``"etcd://HOST:PORT[,HOST:PORT...]/NAME"``
(``kvtide.connect_cluster``; NAME defaults to ``kvtide``). Every difference from Mooncake is listed in docs/python.md.
"""

import ctypes
import re
import struct

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


def error_code(exc):
    """The Mooncake ErrorCode for a kvtide exception."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return INTERNAL_ERROR


def _ints(results, ok=None):
    """Per-key kvtide results as Mooncake ints."""
    out = []
    for r in results:
        if isinstance(r, BaseException):
            out.append(error_code(r))
        else:
            out.append(r if ok is None else ok)
    return out


class ReplicateConfig:
    """Mooncake's ReplicateConfig. kvtide keeps one copy per store: ``replica_num`` and the
    placement fields are accepted and recorded; ``with_hard_pin`` pins the object (never
    evicted until unpinned or removed with force); ``prefer_alloc_in_same_node`` makes puts
    return INVALID_PARAMS, as Mooncake's do."""

    def __init__(self):
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.soft_pin_action = 0
        self.soft_pin_ttl_ms = None
        self.with_hard_pin = False
        self.preferred_segments = []
        self.preferred_nof_segments = []
        self.preferred_segment = ""
        self.prefer_alloc_in_same_node = False
        self.data_type = 0
        self.group_ids = None

    def __str__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"ReplicateConfig({fields})"


class BufferHandle(bytearray):
    """What ``get_buffer`` returns: the object's bytes (a buffer: ``memoryview(h)``,
    ``numpy.frombuffer(h, numpy.uint8)``), with Mooncake's ``ptr()`` and ``size()``."""

    def ptr(self):
        if len(self) == 0:
            return 0
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

    def size(self):
        return len(self)


def _raw(ptr, size):
    if not isinstance(ptr, int) or not isinstance(size, int) or ptr < 0 or size < 0:
        raise TypeError("buffer_ptr and size must be non-negative integers")
    return (ptr, size)


def _bytes_like(value):
    """Mooncake's ``py::buffer`` arguments: any buffer-protocol object (a TypeError otherwise)."""
    try:
        return memoryview(value).cast("B")
    except TypeError:
        raise TypeError(f"expected a buffer (bytes, bytearray, memoryview, numpy array), got {type(value).__name__}")


class MooncakeDistributedStore:
    """Mooncake Store's client class, on a kvtide store (embedded or through an owner)."""

    def __init__(self):
        self._store = None
        self._hostname = ""
        self._registered = {}

    # ---- setup and lifecycle -----------------------------------------------------------------

    def setup(self, local_hostname, metadata_server=None, global_segment_size=None, local_buffer_size=None,
              protocol=None, rdma_devices=None, master_server_addr=None, engine=None, enable_ssd_offload=False,
              ssd_offload_path="", tenant_id="default", enable_client_http_server=False, client_http_port=9300):
        """Mooncake's ``setup``: positionally, the first seven arguments are required; or one
        dict with ``local_hostname`` and ``metadata_server`` required and the rest optional.
        Returns 0, or INVALID_PARAMS (bad arguments, or kvtide could not open) or RPC_FAIL (no
        owner at ``master_server_addr``)."""
        if isinstance(local_hostname, dict):
            config = {k: str(v) for k, v in local_hostname.items()}
            if "local_hostname" not in config or "metadata_server" not in config:
                return INVALID_PARAMS
            segment_bytes = kvtide_parse_size(config.get("global_segment_size", 16 << 20))
            if segment_bytes is None:
                return INVALID_PARAMS
            return self._setup(
                config["local_hostname"],
                segment_bytes,
                config.get("master_server_addr", "127.0.0.1:50051"),
                config.get("enable_ssd_offload", "false").lower() in ("1", "true", "yes", "on"),
                config.get("ssd_offload_path", ""),
            )
        required = (metadata_server, global_segment_size, local_buffer_size, protocol, rdma_devices,
                    master_server_addr)
        if any(a is None for a in required):
            raise TypeError("setup() takes local_hostname, metadata_server, global_segment_size, local_buffer_size, "
                            "protocol, rdma_devices and master_server_addr, or one config dict")
        segment_bytes = _size_argument(global_segment_size)
        if segment_bytes is None:
            return INVALID_PARAMS
        return self._setup(local_hostname, segment_bytes, master_server_addr, bool(enable_ssd_offload),
                           ssd_offload_path)

    def _setup(self, hostname, segment_bytes, address, ssd, ssd_path):
        if not hostname:
            return INVALID_PARAMS
        try:
            if address in ("", "embedded"):
                settings = {"dram_bytes": max(segment_bytes, 16 << 20)}
                if ssd and ssd_path:
                    settings["ssd_dir"] = ssd_path
                store = kvtide.Store(env=True, **settings)
            elif address.startswith(("etcd://", "etcds://")):
                store = kvtide.connect_cluster(*_cluster_address(address))
            else:
                store = kvtide.connect(address)
        except kvtide.KvtideError as e:
            return error_code(e) if not isinstance(e, kvtide.InvalidArgument) else INVALID_PARAMS
        if self._store is not None:
            self._store.close()
        self._store = store
        self._hostname = hostname
        return OK

    def setup_dummy(self, mem_pool_size, local_buffer_size, server_address):
        """Mooncake's client of a separate store process: here, a kvtide owner at
        ``server_address``."""
        pool_bytes = _size_argument(mem_pool_size)
        if pool_bytes is None:
            return INVALID_PARAMS
        return self._setup("dummy", pool_bytes, server_address, False, "")

    def init_all(self, protocol, device_name, mount_segment_size):
        """Mooncake's legacy helper: INVALID_PARAMS once set up, as Mooncake's."""
        if self._store is not None:
            return INVALID_PARAMS
        segment_bytes = _size_argument(mount_segment_size)
        if segment_bytes is None:
            return INVALID_PARAMS
        return self._setup("localhost:12345", segment_bytes, "embedded", False, "")

    def close(self):
        """Closes the store (an embedded one shuts down cleanly). Idempotent; returns 0."""
        if self._store is not None:
            self._store.close()
            self._store = None
            self._hostname = ""
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
        return self._hostname

    # ---- writes --------------------------------------------------------------------------------

    def _opts(self, config):
        pin = bool(config is not None and config.with_hard_pin)
        bad = config is not None and config.prefer_alloc_in_same_node
        return pin, bad

    def _put(self, key, sources, config, upsert):
        if self._store is None:
            return INVALID_PARAMS
        pin, bad = self._opts(config)
        if bad or not key:
            return INVALID_PARAMS
        try:
            self._store.put_from(key, sources, upsert=upsert, pin=pin)
            return OK
        except kvtide.AlreadyExists:
            return OK  # Mooncake keeps the existing value and reports success
        except kvtide.KvtideError as e:
            return error_code(e)

    def put(self, key, value, config=None):
        value = _bytes_like(value)
        if len(value) == 0:
            return INVALID_PARAMS
        return self._put(key, value, config, upsert=False)

    def upsert(self, key, value, config=None):
        value = _bytes_like(value)
        if len(value) == 0:
            return INVALID_PARAMS
        return self._put(key, value, config, upsert=True)

    def put_parts(self, key, *parts, config=None):
        return self._parts(key, parts, config, upsert=False)

    def upsert_parts(self, key, *parts, config=None):
        return self._parts(key, parts, config, upsert=True)

    def _parts(self, key, parts, config, upsert):
        views = []
        for p in parts:
            v = memoryview(p)
            if v.ndim != 1 or v.itemsize != 1:
                raise RuntimeError("parts must be 1-D bytes-like")
            views.append(v)
        if sum(len(v) for v in views) == 0:
            return OK  # Mooncake stores nothing and reports success
        return self._put(key, views, config, upsert)

    def put_from(self, key, buffer_ptr, size, config=None):
        if size == 0 and self._store is not None:
            return OK  # Mooncake stores nothing and reports success
        return self._put(key, _raw(buffer_ptr, size), config, upsert=False)

    def upsert_from(self, key, buffer_ptr, size, config=None):
        if size == 0 and self._store is not None:
            return OK
        return self._put(key, _raw(buffer_ptr, size), config, upsert=True)

    def _batch_put(self, keys, sources, config, upsert):
        pin, bad = self._opts(config)
        if bad or len(keys) != len(sources):
            return [INVALID_PARAMS] * len(keys)
        results = self._store.batch_put_from_multi_buffers(keys, sources, upsert=upsert, pin=pin)
        # Mooncake keeps an existing value and reports success.
        return _ints([None if isinstance(r, kvtide.AlreadyExists) else r for r in results], ok=OK)

    def put_batch(self, keys, values, config=None):
        """One int: 0, or the first failing key's code."""
        if self._store is None or len(keys) != len(values):
            return INVALID_PARAMS
        views = [_bytes_like(v) for v in values]
        if any(len(v) == 0 for v in views):
            return INVALID_PARAMS
        for code in self._batch_put(keys, [[v] for v in views], config, upsert=False):
            if code != OK:
                return code
        return OK

    def upsert_batch(self, keys, values, config=None):
        """One int: 0, or the first failing key's code (an empty value is INVALID_PARAMS, as in
        ``put_batch``)."""
        if self._store is None or len(keys) != len(values):
            return INVALID_PARAMS
        views = [_bytes_like(v) for v in values]
        if any(len(v) == 0 for v in views):
            return INVALID_PARAMS
        for code in self._batch_put(keys, [[v] for v in views], config, upsert=True):
            if code != OK:
                return code
        return OK

    def batch_put_from(self, keys, buffer_ptrs, sizes, config=None):
        if self._store is None or not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        return self._batch_put(keys, [[_raw(p, s)] for p, s in zip(buffer_ptrs, sizes)], config, upsert=False)

    def batch_upsert_from(self, keys, buffer_ptrs, sizes, config=None):
        if self._store is None or not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        return self._batch_put(keys, [[_raw(p, s)] for p, s in zip(buffer_ptrs, sizes)], config, upsert=True)

    def batch_put_from_multi_buffers(self, keys, all_buffer_ptrs, all_sizes, config=None):
        if self._store is None:
            return []
        sources = _scatter_lists(keys, all_buffer_ptrs, all_sizes)
        if sources is None:
            return [INVALID_PARAMS] * len(keys)
        return self._batch_put(keys, sources, config, upsert=False)

    # ---- reads ---------------------------------------------------------------------------------

    def get(self, key):
        """The object's bytes, or b"" on a miss or any failure."""
        if self._store is None:
            return b""
        try:
            return self._store.get(key)
        except kvtide.KvtideError:
            return b""

    def get_batch(self, keys):
        """bytes per key (b"" for a miss); ``[b""]`` for no keys, as Mooncake's."""
        if self._store is None or len(keys) == 0:
            return [b""]
        return [self.get(k) for k in keys]

    def get_buffer(self, key):
        """A BufferHandle with the object's bytes, or None on a miss (or an empty object)."""
        if self._store is None:
            return None
        try:
            size = self._store.get_size(key)
            if size == 0:
                return None
            handle = BufferHandle(size)
            n = self._store.get_into(key, handle)
            del handle[n:]
            return handle
        except kvtide.KvtideError:
            return None

    def batch_get_buffer(self, keys):
        return [self.get_buffer(k) for k in keys]

    def get_into(self, key, buffer_ptr, size):
        """The object's size, INVALID_PARAMS if ``size`` is smaller (nothing written),
        OBJECT_NOT_FOUND on a miss."""
        if self._store is None:
            return INVALID_PARAMS
        try:
            return self._store.get_into(key, _raw(buffer_ptr, size))
        except kvtide.KvtideError as e:
            return error_code(e)

    def batch_get_into(self, keys, buffer_ptrs, sizes):
        if self._store is None or not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        if not keys:
            return []
        dsts = [_raw(p, s) for p, s in zip(buffer_ptrs, sizes)]
        return _ints(self._store.batch_get_into(keys, dsts))

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
        """Per buffer, the fragments (key, dst offset, src offset, size) of it: one int per
        fragment (bytes read or a negative code), per buffer."""
        n = len(buffer_ptrs)
        shaped = [len(all_keys[b]) if b < len(all_keys) else -1 for b in range(n)]
        if self._store is None or not (n == len(all_keys) == len(all_dst_offsets) == len(all_src_offsets)
                                       == len(all_sizes)):
            return [[INVALID_PARAMS] * max(k, 0) for k in shaped]
        buffers, fragments = [], []
        for b, ptr in enumerate(buffer_ptrs):
            keys, dst, src, sizes = all_keys[b], all_dst_offsets[b], all_src_offsets[b], all_sizes[b]
            if not (len(keys) == len(dst) == len(src) == len(sizes)):
                return [[INVALID_PARAMS] * max(k, 0) for k in shaped]
            end = max([d + s for d, s in zip(dst, sizes)], default=0)
            buffers.append(_raw(ptr, end))
            fragments.append([(k, s_off, d_off, size) for k, d_off, s_off, size in zip(keys, dst, src, sizes)])
        return [_ints(r) for r in self._store.get_into_ranges(buffers, fragments)]

    # ---- existence, size, removal -----------------------------------------------------------

    def is_exist(self, key):
        """1 present, 0 absent, a negative code on error."""
        if self._store is None:
            return INVALID_PARAMS
        try:
            return 1 if self._store.exists(key) else 0
        except kvtide.KvtideError as e:
            return error_code(e)

    def batch_is_exist(self, keys):
        if self._store is None:
            return [INVALID_PARAMS] * len(keys)
        return [(1 if r else 0) if isinstance(r, bool) else r for r in _ints(self._store.batch_exists(keys))]

    def get_size(self, key):
        """The object's size, or a negative code (OBJECT_NOT_FOUND on a miss)."""
        if self._store is None:
            return INVALID_PARAMS
        try:
            return self._store.get_size(key)
        except kvtide.KvtideError as e:
            return error_code(e)

    def remove(self, key, force=False):
        """0, OBJECT_NOT_FOUND, or OBJECT_HAS_LEASE while it is read or pinned (unless force)."""
        if self._store is None:
            return INVALID_PARAMS
        try:
            self._store.remove(key, force=force)
            return OK
        except kvtide.KvtideError as e:
            return error_code(e)

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

    # ---- buffer registration ----------------------------------------------------------------

    def register_buffer(self, buffer_ptr, size):
        """Records the buffer (kvtide reads and writes host memory without registration; GPU
        memory is registered by the transports as needed). 0, or INVALID_PARAMS."""
        if self._store is None:
            return INVALID_PARAMS
        _raw(buffer_ptr, size)
        if buffer_ptr == 0:
            return INVALID_PARAMS
        self._registered[buffer_ptr] = size
        return OK

    def unregister_buffer(self, buffer_ptr):
        if self._store is None or self._registered.pop(buffer_ptr, None) is None:
            return INVALID_PARAMS
        return OK

    # ---- tensors (torch) ----------------------------------------------------------------------

    def put_tensor(self, key, tensor):
        return self._put_tensor(key, tensor, upsert=False)

    def upsert_tensor(self, key, tensor):
        return self._put_tensor(key, tensor, upsert=True)

    def _put_tensor(self, key, tensor, upsert):
        if self._store is None:
            return INVALID_PARAMS
        try:
            header, data = _tensor_parts(tensor)
        except (TypeError, ValueError):
            return INVALID_PARAMS
        return self._put(key, [header, data], None, upsert)

    def get_tensor(self, key):
        """The tensor, or None on any failure."""
        raw = self.get(key)
        return _tensor_from(raw) if raw else None

    def batch_put_tensor(self, keys, tensors_list):
        if len(keys) != len(tensors_list):
            return [INVALID_PARAMS] * len(keys)
        return [self.put_tensor(k, t) for k, t in zip(keys, tensors_list)]

    def batch_get_tensor(self, keys):
        return [self.get_tensor(k) for k in keys]

    def put_tensor_with_tp(self, key, tensor, tp_rank=0, tp_size=1, split_dim=0):
        """Stores all ``tp_size`` shards of ``tensor`` (split along ``split_dim``) as
        ``{key}_tp_{rank}``; the first failing shard's code, else 0."""
        if tp_size <= 1:
            return self.put_tensor(key, tensor)
        for rank, shard in enumerate(tensor.chunk(tp_size, dim=split_dim)):
            code = self.put_tensor(f"{key}_tp_{rank}", shard.contiguous())
            if code != OK:
                return code
        return OK

    def get_tensor_with_tp(self, key, tp_rank=0, tp_size=1, split_dim=0):
        return self.get_tensor(key if tp_size <= 1 else f"{key}_tp_{tp_rank}")

    def batch_put_tensor_with_tp(self, base_keys, tensors_list, tp_rank=0, tp_size=1, split_dim=0):
        return [self.put_tensor_with_tp(k, t, tp_rank, tp_size, split_dim) for k, t in zip(base_keys, tensors_list)]

    def batch_get_tensor_with_tp(self, base_keys, tp_rank=0, tp_size=1):
        return [self.get_tensor_with_tp(k, tp_rank, tp_size) for k in base_keys]

    def get_tensor_into(self, key, buffer_ptr, size):
        """The tensor as a view over ``[buffer_ptr, +size)`` (which receives the stored
        header and data), or None."""
        if self._store is None or buffer_ptr == 0:
            return None
        n = self.get_into(key, buffer_ptr, size)
        if n < 0:
            return None
        return _tensor_view(buffer_ptr, n)

    def batch_get_tensor_into(self, keys, buffer_ptrs, sizes):
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        return [self.get_tensor_into(k, p, s) for k, p, s in zip(keys, buffer_ptrs, sizes)]


def _size_argument(value):
    """A size given as a number or as text ('16MB'): its bytes, or None when text does not
    read as one. Other types raise TypeError, as Mooncake's bindings do."""
    if isinstance(value, str):
        return kvtide_parse_size(value)
    return int(value)


def kvtide_parse_size(text):
    """'16777216', '16MB', '16 MiB', '1.5GB' as bytes (binary units), or None."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*", str(text))
    if not m:
        return None
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def _scatter_lists(keys, all_buffer_ptrs, all_sizes):
    """Per key, its list of (ptr, size) buffers; None when the lists' lengths do not match."""
    if not (len(keys) == len(all_buffer_ptrs) == len(all_sizes)):
        return None
    lists = []
    for ptrs, sizes in zip(all_buffer_ptrs, all_sizes):
        if len(ptrs) != len(sizes):
            return None
        lists.append([_raw(p, s) for p, s in zip(ptrs, sizes)])
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


# Tensor objects: a header (magic, dtype name, shape) then the raw bytes. The layout is
# kvtide's own (Mooncake's TensorMetadata is not reproduced): tensors written through this
# class read back through it.
_MAGIC = b"KVTT"


def _tensor_parts(tensor):
    import torch  # noqa: F401  (torch is needed only by the tensor helpers)

    if not hasattr(tensor, "dtype") or not hasattr(tensor, "shape"):
        raise TypeError("expected a torch.Tensor")
    t = tensor.detach()
    if t.is_cuda:
        t = t.cpu()
    t = t.contiguous()
    dtype = str(t.dtype).removeprefix("torch.").encode()
    shape = list(t.shape)
    header = _MAGIC + struct.pack("<HH", len(dtype), len(shape)) + dtype + struct.pack(f"<{len(shape)}q", *shape)
    data = t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return header, data


def _parse_header(raw, n):
    """(torch dtype, shape, header length) of a value of ``n`` bytes written by ``put_tensor``,
    or None when it is not one (wrong magic, truncated, unknown dtype, or a body whose size does
    not match the shape): a stored value is outside input, never trusted."""
    import torch

    try:
        if n < 8 or bytes(raw[:4]) != _MAGIC:
            return None
        dlen, ndim = struct.unpack_from("<HH", raw, 4)
        at = 8 + dlen
        dtype = bytes(raw[8:at]).decode()
        shape = list(struct.unpack_from(f"<{ndim}q", raw, at))
    except (struct.error, UnicodeDecodeError):
        return None
    at += 8 * ndim
    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype) or any(d < 0 for d in shape):
        return None
    count = 1
    for d in shape:
        count *= d
    if at > n or (n - at) != count * dt.itemsize:
        return None
    return dt, shape, at


def _tensor_from(raw):
    import torch

    parsed = _parse_header(raw, len(raw))
    if parsed is None:
        return None
    dt, shape, at = parsed
    if len(raw) == at:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(raw[at:]), dtype=dt).reshape(shape)


def _tensor_view(ptr, n):
    import torch

    parsed = _parse_header(memoryview((ctypes.c_char * n).from_address(ptr)), n)
    if parsed is None:
        return None
    dt, shape, at = parsed
    if n == at:
        return torch.empty(shape, dtype=dt)
    body = (ctypes.c_char * (n - at)).from_address(ptr + at)
    return torch.frombuffer(body, dtype=dt).reshape(shape)
