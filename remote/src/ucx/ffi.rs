//! libucp, loaded at run time: the few entry points and structures the UCX data plane uses, as
//! UCX 1.13's headers declare them (`ucp/api/ucp.h`; later 1.x releases only append fields, and
//! every structure here is read by UCX only as far as its `field_mask` says).
//!
//! Owns the loading (`Ucp::get`: once per process, `libucp.so.0` then `libucp.so`) and the raw
//! declarations. Never calls UCX itself: `ucx/mod.rs` does, through safe owners of each handle.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

pub(crate) type Status = i8;
pub(crate) type StatusPtr = *mut c_void;
pub(crate) type Handle = *mut c_void;

pub(crate) const UCS_OK: Status = 0;
pub(crate) const UCS_INPROGRESS: Status = 1;
pub(crate) const UCS_ERR_NO_DEVICE: Status = -14;
pub(crate) const UCS_ERR_BUSY: Status = -15;
/// Statuses are encoded in pointers in `[UCS_ERR_LAST, 0)`.
const UCS_ERR_LAST: isize = -100;

pub(crate) const UCP_API_MAJOR: c_uint = 1;
pub(crate) const UCP_API_MINOR: c_uint = 13;

pub(crate) const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub(crate) const UCP_PARAM_FIELD_MT_WORKERS_SHARED: u64 = 1 << 5;
pub(crate) const UCP_PARAM_FIELD_NAME: u64 = 1 << 8;
pub(crate) const UCP_FEATURE_RMA: u64 = 1 << 1;
pub(crate) const UCP_FEATURE_WAKEUP: u64 = 1 << 4;

pub(crate) const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
/// `UCS_THREAD_MODE_SERIALIZED`: any thread, one at a time.
pub(crate) const UCS_THREAD_MODE_SERIALIZED: c_int = 1;

pub(crate) const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub(crate) const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub(crate) const UCP_MEM_MAP_PARAM_FIELD_PROT: u64 = 1 << 3;
pub(crate) const UCP_MEM_MAP_PROT_LOCAL_READ: c_uint = 1 << 0;
pub(crate) const UCP_MEM_MAP_PROT_REMOTE_READ: c_uint = 1 << 8;

pub(crate) const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub(crate) const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub(crate) const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
/// `UCP_ERR_HANDLING_MODE_PEER`: a lost peer fails the endpoint's requests.
pub(crate) const UCP_ERR_HANDLING_MODE_PEER: c_int = 1;
pub(crate) const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub(crate) const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

/// `ucp_params_t`.
#[repr(C)]
pub(crate) struct Params {
    pub(crate) field_mask: u64,
    pub(crate) features: u64,
    pub(crate) request_size: usize,
    pub(crate) request_init: *const c_void,
    pub(crate) request_cleanup: *const c_void,
    pub(crate) tag_sender_mask: u64,
    pub(crate) mt_workers_shared: c_int,
    pub(crate) estimated_num_eps: usize,
    pub(crate) estimated_num_ppn: usize,
    pub(crate) name: *const c_char,
}

/// `ucp_worker_params_t` (`cpu_mask` is `ucs_cpu_set_t`: 1024 bits).
#[repr(C)]
pub(crate) struct WorkerParams {
    pub(crate) field_mask: u64,
    pub(crate) thread_mode: c_int,
    pub(crate) cpu_mask: [u64; 16],
    pub(crate) events: c_uint,
    pub(crate) user_data: *mut c_void,
    pub(crate) event_fd: c_int,
    pub(crate) flags: u64,
    pub(crate) name: *const c_char,
    pub(crate) am_alignment: usize,
    pub(crate) client_id: u64,
}

/// `ucp_mem_map_params_t`.
#[repr(C)]
pub(crate) struct MemMapParams {
    pub(crate) field_mask: u64,
    pub(crate) address: *mut c_void,
    pub(crate) length: usize,
    pub(crate) flags: c_uint,
    pub(crate) prot: c_uint,
    pub(crate) memory_type: c_int,
}

/// `ucs_sock_addr_t`.
#[repr(C)]
pub(crate) struct SockAddr {
    pub(crate) addr: *const c_void,
    pub(crate) addrlen: u32,
}

/// `ucp_ep_params_t`.
#[repr(C)]
pub(crate) struct EpParams {
    pub(crate) field_mask: u64,
    pub(crate) address: *const c_void,
    pub(crate) err_mode: c_int,
    pub(crate) err_handler_cb: *const c_void,
    pub(crate) err_handler_arg: *mut c_void,
    pub(crate) user_data: *mut c_void,
    pub(crate) flags: c_uint,
    pub(crate) sockaddr: SockAddr,
    pub(crate) conn_request: *mut c_void,
    pub(crate) name: *const c_char,
    pub(crate) local_sockaddr: SockAddr,
}

/// `ucp_request_param_t`.
#[repr(C)]
pub(crate) struct RequestParam {
    pub(crate) op_attr_mask: u32,
    pub(crate) flags: u32,
    pub(crate) request: *mut c_void,
    pub(crate) cb: *const c_void,
    pub(crate) datatype: u64,
    pub(crate) user_data: *mut c_void,
    pub(crate) reply_buffer: *mut c_void,
    pub(crate) memory_type: c_int,
    pub(crate) recv_info: *mut c_void,
    pub(crate) memh: *mut c_void,
}

impl RequestParam {
    pub(crate) fn with_flags(flags: u32) -> RequestParam {
        RequestParam {
            op_attr_mask: if flags == 0 { 0 } else { UCP_OP_ATTR_FIELD_FLAGS },
            flags,
            request: std::ptr::null_mut(),
            cb: std::ptr::null(),
            datatype: 0,
            user_data: std::ptr::null_mut(),
            reply_buffer: std::ptr::null_mut(),
            memory_type: 0,
            recv_info: std::ptr::null_mut(),
            memh: std::ptr::null_mut(),
        }
    }
}

/// The status a `ucs_status_ptr_t` carries: `Ok(None)` done, `Ok(Some(request))` in flight,
/// `Err(status)` failed.
pub(crate) fn status_of_ptr(ptr: StatusPtr) -> Result<Option<Handle>, Status> {
    let value = ptr as isize;
    if value == 0 {
        Ok(None)
    } else if (UCS_ERR_LAST..0).contains(&value) {
        Err(value as Status)
    } else {
        Ok(Some(ptr))
    }
}

macro_rules! ucp_api {
    ($( $name:ident : fn($($arg:ty),*) -> $ret:ty; )*) => {
        /// libucp's entry points used here.
        #[allow(non_snake_case)]
        pub(crate) struct Ucp {
            #[cfg(feature = "ucx")]
            _lib: libloading::Library,
            /// `ucs_status_string`, from libucs (loaded with libucp).
            status_string: unsafe extern "C" fn(Status) -> *const c_char,
            $( pub(crate) $name: unsafe extern "C" fn($($arg),*) -> $ret, )*
        }

        #[cfg(feature = "ucx")]
        impl Ucp {
            /// # Safety
            /// `lib` must be libucp of UCX 1.x, whose symbols have the signatures above.
            unsafe fn bind(lib: libloading::Library, ucs: &libloading::Library) -> Result<Ucp, String> {
                // SAFETY: the symbol has this signature in libucs 1.x.
                let status_string = *unsafe {
                    ucs.get::<unsafe extern "C" fn(Status) -> *const c_char>(b"ucs_status_string\0")
                }
                .map_err(|e| format!("ucs_status_string: {e}"))?;
                $(
                    // SAFETY: the symbol has this signature in libucp 1.x (the caller's contract).
                    let $name = *unsafe {
                        lib.get::<unsafe extern "C" fn($($arg),*) -> $ret>(concat!(stringify!($name), "\0").as_bytes())
                    }
                    .map_err(|e| format!("{}: {e}", stringify!($name)))?;
                )*
                Ok(Ucp { _lib: lib, status_string, $( $name, )* })
            }
        }
    };
}

ucp_api! {
    ucp_get_version: fn(*mut c_uint, *mut c_uint, *mut c_uint) -> ();
    ucp_config_read: fn(*const c_char, *const c_char, *mut Handle) -> Status;
    ucp_config_modify: fn(Handle, *const c_char, *const c_char) -> Status;
    ucp_config_release: fn(Handle) -> ();
    ucp_init_version: fn(c_uint, c_uint, *const Params, Handle, *mut Handle) -> Status;
    ucp_cleanup: fn(Handle) -> ();
    ucp_worker_create: fn(Handle, *const WorkerParams, *mut Handle) -> Status;
    ucp_worker_destroy: fn(Handle) -> ();
    ucp_worker_get_address: fn(Handle, *mut Handle, *mut usize) -> Status;
    ucp_worker_release_address: fn(Handle, Handle) -> ();
    ucp_worker_progress: fn(Handle) -> c_uint;
    ucp_worker_get_efd: fn(Handle, *mut c_int) -> Status;
    ucp_worker_arm: fn(Handle) -> Status;
    ucp_mem_map: fn(Handle, *const MemMapParams, *mut Handle) -> Status;
    ucp_mem_unmap: fn(Handle, Handle) -> Status;
    ucp_rkey_pack: fn(Handle, Handle, *mut Handle, *mut usize) -> Status;
    ucp_rkey_buffer_release: fn(Handle) -> ();
    ucp_ep_create: fn(Handle, *const EpParams, *mut Handle) -> Status;
    ucp_ep_close_nbx: fn(Handle, *const RequestParam) -> StatusPtr;
    ucp_ep_rkey_unpack: fn(Handle, *const c_void, *mut Handle) -> Status;
    ucp_rkey_destroy: fn(Handle) -> ();
    ucp_get_nbx: fn(Handle, *mut c_void, usize, u64, Handle, *const RequestParam) -> StatusPtr;
    ucp_request_check_status: fn(Handle) -> Status;
    ucp_request_free: fn(Handle) -> ();
}

impl Ucp {
    /// libucp, loaded once per process; the error says what is missing.
    pub(crate) fn get() -> Result<&'static Ucp, &'static str> {
        static UCP: OnceLock<Result<Ucp, String>> = OnceLock::new();
        UCP.get_or_init(load).as_ref().map_err(String::as_str)
    }

    /// UCX's own words for `status`.
    pub(crate) fn describe(&self, status: Status) -> String {
        // SAFETY: ucs_status_string returns a static NUL-terminated string for any status.
        let text = unsafe { (self.status_string)(status) };
        if text.is_null() {
            return format!("UCX status {status}");
        }
        // SAFETY: non-null, NUL-terminated, static (above).
        unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
    }

    /// (major, minor) of the loaded library.
    pub(crate) fn version(&self) -> (u32, u32) {
        let (mut major, mut minor, mut release) = (0, 0, 0);
        // SAFETY: writes three unsigned ints.
        unsafe { (self.ucp_get_version)(&mut major, &mut minor, &mut release) };
        (major, minor)
    }
}

#[cfg(not(feature = "ucx"))]
fn load() -> Result<Ucp, String> {
    Err("kvtide-remote was built without its `ucx` feature".into())
}

#[cfg(feature = "ucx")]
fn load() -> Result<Ucp, String> {
    let open = |names: &[&str]| {
        let mut last = String::new();
        for name in names {
            // SAFETY: loading UCX runs its constructors, which only set up its own state.
            match unsafe { libloading::Library::new(*name) } {
                Ok(lib) => return Ok(lib),
                Err(e) => last = e.to_string(),
            }
        }
        Err(format!("{} not found ({last}); install UCX (Debian: libucx0)", names[0]))
    };
    // libucs first: libucp needs it, and ucs_status_string lives there.
    let ucs = open(&["libucs.so.0", "libucs.so"])?;
    let ucp = open(&["libucp.so.0", "libucp.so"])?;
    // SAFETY: these are UCX's libraries; every symbol is declared as its 1.x header declares it.
    let api = unsafe { Ucp::bind(ucp, &ucs) }?;
    let (major, minor) = api.version();
    if major != 1 || minor < 13 {
        return Err(format!("UCX {major}.{minor} is too old (1.13 or later is needed)"));
    }
    // libucs stays loaded as long as libucp, which links it.
    std::mem::forget(ucs);
    Ok(api)
}
