//! The UCX data plane: one-sided reads of the owner's arena by remote clients, over whichever
//! network transport UCX finds (RDMA verbs on a cluster, its TCP transport here).
//!
//! Owns the UCX handles (each freed by its owner's `Drop`, in the order UCX requires), the
//! transports a plane may use (`Transports`: network ones only, never shared memory or CMA), the
//! process that serves the owner's arena (`helper.rs`: a read-only mapping registered for remote
//! reads; `export.rs` starts and restarts it, so UCX never runs in the owner's address space) and
//! a client's reader of it (`reader.rs`: gets straight into the caller's host memory). Never decides what may be read: a client reads
//! only ranges the owner granted it on the control connection, under a lease, as a same-host
//! client copies them out of the arena mapping.

mod export;
mod ffi;
mod helper;
mod reader;
mod sandbox;

use std::ffi::{c_void, CString};
use std::sync::Arc;

pub(crate) use export::UcxExport;
pub use export::UcxPlaneState;
pub use helper::{ucx_plane_main, UCX_PLANE_ARG};
pub use sandbox::self_check as ucx_plane_confinement_check;
/// The argument that runs `ucx_plane_confinement_check` in `kvtide-owner`.
pub const UCX_PLANE_CONFINED_ARG: &str = "__ucx-plane-confined";
pub(crate) use reader::UcxArena;

/// A client's UCX context (one per `RemoteStore`; each connection has its own worker, which a
/// read sleeps on once its gets take longer than a spin).
/// Over `tcp` alone to an owner on loopback, UCX opens its tcp transport on `lo` only
/// (unless `UCX_NET_DEVICES` says otherwise): its port then takes no peer from the network.
pub(crate) fn client_context(transports: &Transports, owner_on_loopback: bool) -> UResult<Arc<Context>> {
    let settings: Vec<(&str, &str)> =
        transports.loopback_devices(owner_on_loopback).map(|d| ("NET_DEVICES", d)).into_iter().collect();
    Context::new(transports, true, &settings)
}

use ffi::{Handle, Status, Ucp};

/// Version of the UCX plane's attach exchange (`UcxAttach` / `UcxReady`); a peer speaking
/// another is answered with an error and the client keeps the TCP path.
pub const UCX_PLANE_VERSION: u32 = 1;

/// The most UCX workers (threads) the plane's process serves with (`OwnerConfig::ucx_workers`).
pub const MAX_UCX_WORKERS: usize = 64;
/// Workers when the configuration leaves it to the host: one per CPU, at most this many.
const AUTO_UCX_WORKERS: usize = 16;

/// The plane's workers for a configured count (0: one per CPU of this host, at most
/// `AUTO_UCX_WORKERS`).
pub(crate) fn plane_workers(configured: usize) -> usize {
    match configured {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()).min(AUTO_UCX_WORKERS),
        n => n.min(MAX_UCX_WORKERS),
    }
}

/// A failure of the UCX plane. Every one leaves the client on the TCP path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UcxError {
    /// libucp is missing or too old.
    #[error("the UCX data plane is not available: {0}")]
    Unavailable(String),
    /// A UCX call failed.
    #[error("UCX {call} failed: {status}")]
    Call { call: &'static str, status: String },
    /// None of the transports has a device on this host (rc, dc and ud need an RDMA NIC).
    #[error(
        "UCX found no device for the transports {0:?} on this host (rc, dc and ud need an RDMA NIC that \
         UCX can open; `ucx_info -d` lists the devices UCX sees)"
    )]
    NoDevice(String),
    /// The plane's process did not start or serve (its own reason, where it gave one).
    #[error("the UCX plane process did not start: {0}")]
    Plane(String),
    /// A transport list this plane does not allow.
    #[error("UCX transports {0:?} are not allowed: {1}")]
    Transports(String, &'static str),
    /// The plane did not answer from here (UCX connects only when an endpoint is first used).
    #[error("the UCX plane cannot be reached from this host: {0}")]
    Unreachable(String),
    /// A get did not complete in time (the endpoint was closed, so nothing lands later).
    #[error("a UCX read did not complete within {timeout_ms} ms")]
    Timeout { timeout_ms: u64 },
    /// A get asked for bytes outside the exported arena.
    #[error("a UCX read outside the owner's arena")]
    OutOfBounds,
}

impl From<UcxError> for crate::Error {
    fn from(e: UcxError) -> Self {
        match e {
            UcxError::Timeout { timeout_ms } => crate::Error::Timeout { op: "UCX read", timeout_ms },
            other => crate::Error::Disconnected(other.to_string()),
        }
    }
}

pub(crate) type UResult<T> = std::result::Result<T, UcxError>;

fn ucp() -> UResult<&'static Ucp> {
    Ucp::get().map_err(|e| UcxError::Unavailable(e.to_string()))
}

fn check(ucp: &Ucp, call: &'static str, status: Status) -> UResult<()> {
    if status == ffi::UCS_OK {
        Ok(())
    } else {
        Err(UcxError::Call { call, status: ucp.describe(status) })
    }
}

/// The (major, minor) version of libucp when this process can load it, else why not.
pub fn ucx_available() -> std::result::Result<(u32, u32), String> {
    ucp().map(Ucp::version).map_err(|e| e.to_string())
}

/// The UCX transports a plane may use: UCX names (`UCX_TLS` syntax, comma-separated), checked
/// against the network transports. Shared-memory transports (`sm`, `posix`, `sysv`, `cma`, `knem`,
/// `xpmem`, `cuda_ipc`) would let a peer reach into this process's address space, and `all`
/// or an exclusion list (`^...`) could select them, so both are refused. `tcp` moves one-sided
/// reads in software: the serving side copies from whatever address a peer names, without
/// checking it against a registration, so it is allowed only when `allow_tcp` says so.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transports(String);

/// UCX's tcp settings the plane serves with (`Transports::serving_env`).
const TCP_SETTINGS: &[(&str, &str)] = &[("TCP_TX_SEG_SIZE", "64k"), ("TCP_RX_SEG_SIZE", "64k")];

/// UCX's network transport names (and aliases) that hardware checks against registrations.
const RDMA_TRANSPORTS: &[&str] = &[
    "ib",
    "rc",
    "rc_v",
    "rc_x",
    "rc_verbs",
    "rc_mlx5",
    "dc",
    "dc_x",
    "dc_mlx5",
    "ud",
    "ud_v",
    "ud_x",
    "ud_verbs",
    "ud_mlx5",
    "cuda_copy",
    "gdr_copy",
    "rocm_copy",
];

impl Transports {
    /// The RDMA transports (what an owner serves by default).
    pub fn rdma() -> Transports {
        Transports("rc,dc,ud".to_string())
    }

    /// Checks `list` ("rdma" names the RDMA transports, as in settings); `tcp` in it needs
    /// `allow_tcp`.
    pub fn parse(list: &str, allow_tcp: bool) -> UResult<Transports> {
        if list.trim().eq_ignore_ascii_case("rdma") {
            return Ok(Transports::rdma());
        }
        let names: Vec<&str> = list.split(',').map(str::trim).filter(|n| !n.is_empty()).collect();
        if names.is_empty() {
            return Err(UcxError::Transports(list.into(), "the list is empty"));
        }
        for name in &names {
            if *name == "tcp" {
                if !allow_tcp {
                    return Err(UcxError::Transports(
                        list.into(),
                        "tcp serves one-sided reads in software without checking them against the registration; \
                         allow it explicitly (ucx_allow_tcp) only on a trusted network",
                    ));
                }
            } else if !RDMA_TRANSPORTS.contains(name) {
                return Err(UcxError::Transports(
                    list.into(),
                    "only network transports are allowed (ib, rc, dc, ud and their variants, cuda_copy, gdr_copy, tcp)",
                ));
            }
        }
        Ok(Transports(names.join(",")))
    }

    /// A setting's value as the transport list it names: "off" or empty is none, "rdma" the
    /// RDMA transports, anything else a list (checked by `parse` where it is used). The one
    /// reading of `[owner] ucx`, `KVTIDE_UCX_TRANSPORTS` and Python's `ucx=`.
    pub fn from_setting(value: &str) -> Option<String> {
        match value.trim() {
            v if v.is_empty() || v.eq_ignore_ascii_case("off") => None,
            v if v.eq_ignore_ascii_case("rdma") => Some(Transports::rdma().0),
            list => Some(list.to_string()),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn has_tcp(&self) -> bool {
        self.0.split(',').any(|n| n == "tcp")
    }

    /// The UCX variables (full names) a process serving the plane over these transports gets
    /// beyond its environment's, for an owner on loopback or not: `loopback_devices`, and
    /// `TCP_SETTINGS` over `tcp` (64 KiB segments instead of 8 KiB, so a get's bytes go out in an
    /// eighth of the fragments: a 1 MiB get over loopback, about 4 against 1.9 GB/s,
    /// docs/benchmarks.md; the serving side's are the ones that count, a client keeps UCX's,
    /// measured the same). Each only where the environment does not set it. `kvtide-bench`
    /// gives its `ucx_perftest` baseline the same.
    pub fn serving_env(&self, loopback: bool) -> Vec<(String, &'static str)> {
        let devices = self.loopback_devices(loopback).map(|d| ("NET_DEVICES", d));
        let tcp = if self.has_tcp() { TCP_SETTINGS } else { &[] };
        devices
            .into_iter()
            .chain(tcp.iter().copied())
            .map(|(name, value)| (format!("UCX_{name}"), value))
            .filter(|(var, _)| std::env::var_os(var).is_none())
            .collect()
    }

    /// `Some("lo")` for `tcp` alone when the other side is on loopback and `UCX_NET_DEVICES` is
    /// not set: UCX's tcp transport (which serves any address a peer names) then listens on
    /// the loopback interface only. With other transports the devices stay UCX's choice.
    pub(crate) fn loopback_devices(&self, loopback: bool) -> Option<&'static str> {
        (loopback && self.0 == "tcp" && std::env::var_os("UCX_NET_DEVICES").is_none()).then_some("lo")
    }
}

/// A UCX context limited to `transports`, with RMA (and wake-ups when `wakeup`).
pub(crate) struct Context {
    ucp: &'static Ucp,
    raw: Handle,
}

// SAFETY: every context is made with `mt_workers_shared` (UCX locks it for workers made, used
// and destroyed on different threads); memory mapping and rkey packing happen in the plane's
// process before its workers serve.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// `settings`: UCX configuration (names without `UCX_`) set over the environment's.
    pub(crate) fn new(transports: &Transports, wakeup: bool, settings: &[(&str, &str)]) -> UResult<Arc<Context>> {
        let ucp = ucp()?;
        let mut config: Handle = std::ptr::null_mut();
        // SAFETY: null prefix and file read the environment's defaults; writes one handle.
        check(ucp, "ucp_config_read", unsafe {
            (ucp.ucp_config_read)(std::ptr::null(), std::ptr::null(), &mut config)
        })?;
        let tls = CString::new(transports.as_str()).map_err(|_| UcxError::Transports(transports.0.clone(), "a NUL"))?;
        // SAFETY: `config` is live; both strings are NUL-terminated and outlive the call.
        let mut modified = unsafe { (ucp.ucp_config_modify)(config, c"TLS".as_ptr(), tls.as_ptr()) };
        for &(name, value) in settings {
            let (Ok(name), Ok(value)) = (CString::new(name), CString::new(value)) else {
                return Err(UcxError::Transports(format!("{name}={value}"), "a NUL"));
            };
            if modified == ffi::UCS_OK {
                // SAFETY: as above.
                modified = unsafe { (ucp.ucp_config_modify)(config, name.as_ptr(), value.as_ptr()) };
            }
        }
        let mut features = ffi::UCP_FEATURE_RMA;
        if wakeup {
            features |= ffi::UCP_FEATURE_WAKEUP;
        }
        let params = ffi::Params {
            field_mask: ffi::UCP_PARAM_FIELD_FEATURES
                | ffi::UCP_PARAM_FIELD_MT_WORKERS_SHARED
                | ffi::UCP_PARAM_FIELD_NAME,
            features,
            request_size: 0,
            request_init: std::ptr::null(),
            request_cleanup: std::ptr::null(),
            tag_sender_mask: 0,
            // A client's connections each have a worker of one context, used (created,
            // progressed, destroyed) from their own threads: UCX then locks the context.
            mt_workers_shared: 1,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: c"kvtide".as_ptr(),
        };
        let mut raw: Handle = std::ptr::null_mut();
        let init = if modified == ffi::UCS_OK {
            // SAFETY: `params` and `config` are live; writes one handle.
            unsafe { (ucp.ucp_init_version)(ffi::UCP_API_MAJOR, ffi::UCP_API_MINOR, &params, config, &mut raw) }
        } else {
            modified
        };
        // SAFETY: `config` came from ucp_config_read and is released once.
        unsafe { (ucp.ucp_config_release)(config) };
        if init == ffi::UCS_ERR_NO_DEVICE {
            return Err(UcxError::NoDevice(transports.0.clone()));
        }
        check(ucp, "ucp_init", init)?;
        Ok(Arc::new(Context { ucp, raw }))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every worker and memory region holds an Arc of this context, so none is left.
        unsafe { (self.ucp.ucp_cleanup)(self.raw) };
    }
}

/// A worker of a context (`UCS_THREAD_MODE_SERIALIZED`: callers hold it one at a time).
pub(crate) struct Worker {
    ctx: Arc<Context>,
    raw: Handle,
}

// SAFETY: a serialized-mode worker may be used from any thread, one at a time: `UcxExport` uses it
// from its progress thread only, `UcxArena` under its mutex.
unsafe impl Send for Worker {}

impl Worker {
    pub(crate) fn new(ctx: &Arc<Context>) -> UResult<Worker> {
        let params = ffi::WorkerParams {
            field_mask: ffi::UCP_WORKER_PARAM_FIELD_THREAD_MODE,
            thread_mode: ffi::UCS_THREAD_MODE_SERIALIZED,
            cpu_mask: [0; 16],
            events: 0,
            user_data: std::ptr::null_mut(),
            event_fd: -1,
            flags: 0,
            name: std::ptr::null(),
            am_alignment: 0,
            client_id: 0,
        };
        let mut raw: Handle = std::ptr::null_mut();
        // SAFETY: a live context and params; writes one handle.
        check(ctx.ucp, "ucp_worker_create", unsafe { (ctx.ucp.ucp_worker_create)(ctx.raw, &params, &mut raw) })?;
        Ok(Worker { ctx: Arc::clone(ctx), raw })
    }

    /// The worker's address, to hand to peers.
    pub(crate) fn address(&self) -> UResult<Vec<u8>> {
        let ucp = self.ctx.ucp;
        let mut addr: Handle = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: a live worker; writes a pointer and a length.
        check(ucp, "ucp_worker_get_address", unsafe { (ucp.ucp_worker_get_address)(self.raw, &mut addr, &mut len) })?;
        // SAFETY: UCX gave `len` readable bytes at `addr`, released right after the copy.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
        // SAFETY: the address this worker gave, released once.
        unsafe { (ucp.ucp_worker_release_address)(self.raw, addr) };
        Ok(bytes)
    }

    /// Runs the worker's pending work once; the number of events it handled.
    pub(crate) fn progress(&self) -> u32 {
        // SAFETY: a live worker, used by one thread at a time (the type's contract).
        unsafe { (self.ctx.ucp.ucp_worker_progress)(self.raw) }
    }

    /// The descriptor that becomes readable when the armed worker has work.
    pub(crate) fn event_fd(&self) -> UResult<i32> {
        let mut fd = -1;
        // SAFETY: a live worker of a context with wake-ups; writes one int.
        check(self.ctx.ucp, "ucp_worker_get_efd", unsafe { (self.ctx.ucp.ucp_worker_get_efd)(self.raw, &mut fd) })?;
        Ok(fd)
    }

    /// Arms the event descriptor: false when work is already pending (progress again first).
    pub(crate) fn arm(&self) -> UResult<bool> {
        // SAFETY: a live worker of a context with wake-ups.
        let status = unsafe { (self.ctx.ucp.ucp_worker_arm)(self.raw) };
        if status == ffi::UCS_ERR_BUSY {
            return Ok(false);
        }
        check(self.ctx.ucp, "ucp_worker_arm", status).map(|()| true)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: endpoints of this worker are closed before it (their owners hold it).
        unsafe { (self.ctx.ucp.ucp_worker_destroy)(self.raw) };
    }
}

/// Host memory registered with a context for remote reads only.
pub(crate) struct MemRegion {
    ctx: Arc<Context>,
    raw: Handle,
}

// SAFETY: a memory handle is an immutable registration; UCX allows using it from any thread.
unsafe impl Send for MemRegion {}
// SAFETY: as above.
unsafe impl Sync for MemRegion {}

impl MemRegion {
    /// Registers `[addr, addr + len)`: readable by remote peers, never writable by them.
    ///
    /// # Safety
    /// The range must stay mapped until this region is dropped.
    pub(crate) unsafe fn read_only(ctx: &Arc<Context>, addr: *mut u8, len: usize) -> UResult<MemRegion> {
        let params = ffi::MemMapParams {
            field_mask: ffi::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | ffi::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | ffi::UCP_MEM_MAP_PARAM_FIELD_PROT,
            address: addr.cast::<c_void>(),
            length: len,
            flags: 0,
            prot: ffi::UCP_MEM_MAP_PROT_LOCAL_READ | ffi::UCP_MEM_MAP_PROT_REMOTE_READ,
            memory_type: 0,
        };
        let mut raw: Handle = std::ptr::null_mut();
        // SAFETY: a live context; the range is mapped (the caller's contract); writes one handle.
        check(ctx.ucp, "ucp_mem_map", unsafe { (ctx.ucp.ucp_mem_map)(ctx.raw, &params, &mut raw) })?;
        Ok(MemRegion { ctx: Arc::clone(ctx), raw })
    }

    /// The packed remote key peers unpack to read this region.
    pub(crate) fn packed_rkey(&self) -> UResult<Vec<u8>> {
        let ucp = self.ctx.ucp;
        let mut buf: Handle = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: a live context and handle; writes a pointer and a length.
        check(ucp, "ucp_rkey_pack", unsafe { (ucp.ucp_rkey_pack)(self.ctx.raw, self.raw, &mut buf, &mut len) })?;
        // SAFETY: UCX gave `len` readable bytes at `buf`, released right after the copy.
        let bytes = unsafe { std::slice::from_raw_parts(buf as *const u8, len) }.to_vec();
        // SAFETY: the buffer ucp_rkey_pack gave, released once.
        unsafe { (ucp.ucp_rkey_buffer_release)(buf) };
        Ok(bytes)
    }
}

impl Drop for MemRegion {
    fn drop(&mut self) {
        // SAFETY: a live registration, unmapped once; no peer can use it after its worker is gone.
        let status = unsafe { (self.ctx.ucp.ucp_mem_unmap)(self.ctx.raw, self.raw) };
        if status != ffi::UCS_OK {
            tracing::warn!(status = %self.ctx.ucp.describe(status), "ucp_mem_unmap failed");
        }
    }
}

/// How long the progress loop sleeps between checks of its stop flag when idle.
const IDLE_POLL_MS: i32 = 100;

/// Progresses `worker` until `stop`, sleeping on its event descriptor `fd` when idle: software
/// transports (tcp) serve peers' reads here, and every transport's connection set-up does.
pub(crate) fn serve(worker: &Worker, fd: i32, stop: &std::sync::atomic::AtomicBool) {
    use std::sync::atomic::Ordering;
    while !stop.load(Ordering::Acquire) {
        while worker.progress() > 0 {}
        match worker.arm() {
            Ok(false) => continue,
            Ok(true) => {}
            Err(e) => {
                tracing::error!(error = %e, "the UCX plane stopped serving");
                return;
            }
        }
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one live pollfd; the descriptor is the worker's, open while it lives.
        unsafe { libc::poll(&mut pfd, 1, IDLE_POLL_MS) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_network_transports_pass_and_tcp_only_when_allowed() {
        assert_eq!(Transports::parse(" rc, dc ,ud", false).map(|t| t.as_str().to_string()), Ok("rc,dc,ud".into()));
        assert!(Transports::parse("rc_mlx5,cuda_copy,gdr_copy", false).is_ok());
        assert!(Transports::parse("tcp", true).is_ok_and(|t| t.has_tcp()));
        assert!(!Transports::rdma().has_tcp());
        assert_eq!(Transports::parse(" RDMA ", false), Ok(Transports::rdma()), "the settings' alias");
        assert!(Transports::rdma().serving_env(true).is_empty(), "RDMA transports keep UCX's settings");
        if ["UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE", "UCX_NET_DEVICES"]
            .iter()
            .all(|v| std::env::var_os(v).is_none())
        {
            let tcp = Transports::parse("tcp", true).expect("tcp");
            let seg = [("UCX_TCP_TX_SEG_SIZE".to_string(), "64k"), ("UCX_TCP_RX_SEG_SIZE".to_string(), "64k")];
            assert_eq!(tcp.serving_env(false), seg.to_vec());
            assert_eq!(tcp.serving_env(true)[0], ("UCX_NET_DEVICES".to_string(), "lo"));
            assert_eq!(tcp.serving_env(true)[1..], seg[..]);
        }
        assert!(Transports::parse("rdma,tcp", true).is_err(), "an alias, not a transport");
        for (value, named) in
            [("off", None), (" ", None), ("OFF", None), ("rdma", Some("rc,dc,ud")), (" tcp ", Some("tcp"))]
        {
            assert_eq!(Transports::from_setting(value).as_deref(), named, "{value:?}");
        }
        for (list, allow) in [
            ("tcp", false),
            ("rc,tcp", false),
            ("sm", true),
            ("shm", true),
            ("posix", true),
            ("sysv", true),
            ("cma", true),
            ("knem", true),
            ("xpmem", true),
            ("cuda_ipc", true),
            ("self", true),
            ("all", true),
            ("^sm", true),
            ("", true),
            (",", true),
        ] {
            assert!(
                matches!(Transports::parse(list, allow), Err(UcxError::Transports(..))),
                "{list:?} allow tcp {allow}"
            );
        }
    }
}
