//! The CUDA transport: GPU memory as a destination and a source.
//!
//! `plan` (always compiled, tested in CI) decides the path of a request and lays out its bytes:
//! the staged path moves whole objects into one contiguous device staging buffer and runs ONE
//! scatter (reads) or gather (writes) kernel per buffer fill; the direct path issues one copy per
//! piece, contiguous neighbours merged, through `cuMemcpyBatchAsync` where the driver has it.
//!
//! Behind the `cuda` feature the rest is a stack; each module imports only modules listed
//! before it, and `plan` and `profile` (which import no other module here):
//! - `driver`: libcuda, loaded at run time (cudarc, dynamic loading), and each GPU's primary
//!   `Context`; knows no device, pool, kernel or path.
//! - `kernel`: compiles `scatter.cu` and `workload.cu` with NVRTC at first use.
//! - `events`: a GPU's pooled events and streams, back to their pool when dropped.
//! - `staging` and `bound_state`: the per-GPU state of the engine-stream path (the staging unit
//!   and its busy flag) and of stream-bound reads (units bound to callers' streams, gate words).
//! - `gpu`: `CudaDevice`, which composes a GPU's context, kernels, pools and the paths' state,
//!   and `CudaTransport`, the process-wide set of GPUs.
//! - `submission`: the `CudaInFlight` of a submission, completing on the events the caller polls.
//! - `memory`: device and pinned buffers, host registrations, device-pointer checks.
//! - the paths, which never import each other: `device` submits on engine-owned streams (staged
//!   or direct, whole or in parts, with an early start), `bound` on a caller's stream, and
//!   `graph` gives tests and benchmarks the streams, events and graphs an inference worker has.
//! - `copier`: `CudaCopier`, the `Transport` and `StreamSubmit` implementation on top.
//!
//! `profile` (opt-in timelines of staged requests, `KVTIDE_CUDA_PROFILE=1`) only calls libcuda.
//!
//! It never looks up objects or takes leases: the engine hands it validated transfers whose host
//! bytes it keeps leased (or reserved) until the returned `CudaInFlight` has completed. Without the
//! feature, a driver or a GPU, every entry point returns `TransportError::CudaUnavailable`.

pub mod plan;

#[cfg(feature = "cuda")]
mod bound;
#[cfg(feature = "cuda")]
mod bound_state;
#[cfg(feature = "cuda")]
mod copier;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod driver;
#[cfg(feature = "cuda")]
mod events;
#[cfg(feature = "cuda")]
mod gpu;
#[cfg(feature = "cuda")]
mod graph;
#[cfg(feature = "cuda")]
mod kernel;
#[cfg(feature = "cuda")]
mod memory;
#[cfg(feature = "cuda")]
pub mod profile;
#[cfg(feature = "cuda")]
mod staging;
#[cfg(feature = "cuda")]
mod submission;

pub use crate::transfer::Summary;
#[cfg(feature = "cuda")]
pub use bound_state::StreamStaging;
#[cfg(feature = "cuda")]
pub use copier::CudaCopier;
#[cfg(feature = "cuda")]
pub use device::{
    inject_fault, prestage, submit, submit_with, BaselineMode, InjectedFault, PartsSubmission, Prestaged, StagingHold,
};
#[cfg(feature = "cuda")]
pub use gpu::{CudaDevice, CudaTransport};
#[cfg(feature = "cuda")]
pub use graph::{CudaEvent, CudaGraph, CudaStream};
#[cfg(feature = "cuda")]
pub use kernel::{SCATTER_SOURCE, WORKLOAD_SOURCE};
#[cfg(feature = "cuda")]
pub use memory::{DeviceBuffer, HostRegistration, PinnedBuffer, RangeChecker};
#[cfg(feature = "cuda")]
pub use submission::{copy_host_pieces, CudaInFlight};

/// True when this build has the CUDA transport (the `cuda` feature).
pub const BUILT_WITH_CUDA: bool = cfg!(feature = "cuda");

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;

    #[test]
    fn no_gpu_is_cuda_unavailable_not_a_panic() {
        // CI has no driver: the transport must say so. On a GPU machine it loads.
        match CudaTransport::get() {
            Err(crate::TransportError::CudaUnavailable(why)) => assert!(!why.is_empty()),
            Err(other) => panic!("expected CudaUnavailable, got {other}"),
            Ok(transport) => assert!(transport.device_count() > 0),
        }
        // Asking twice gives the same answer (cached, no second load attempt that could panic).
        assert_eq!(CudaTransport::get().is_ok(), CudaTransport::get().is_ok());
    }

    #[test]
    fn kernel_source_has_both_entry_points() {
        assert!(SCATTER_SOURCE.contains("extern \"C\" __global__ void kvtide_scatter"));
        assert!(SCATTER_SOURCE.contains("extern \"C\" __global__ void kvtide_gather"));
        assert!(SCATTER_SOURCE.contains("extern \"C\" __global__ void kvtide_scatter_gated"));
        assert!(WORKLOAD_SOURCE.contains("extern \"C\" __global__ void kvtide_spin"));
        // The row layout in the source matches `plan::Descriptor` (16 bytes: u64, u32, u32).
        assert_eq!(std::mem::size_of::<plan::Descriptor>(), 16);
        assert!(SCATTER_SOURCE.contains("unsigned long long page;"));
    }
}
