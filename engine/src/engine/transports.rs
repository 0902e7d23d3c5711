//! Which transport moves a call's bytes, by the kind of memory its regions are in.
//!
//! Owns the routing rule (a region list that names GPU memory goes to the GPU transport, which
//! also copies its host pieces; anything else is CPU copies), the checks of region lists before
//! anything is submitted (a large call's over a few threads, `parallel`), and the keep-awake count
//! that makes shards poll while an asynchronous transfer holds their leases. It never moves
//! bytes and never chooses staged or direct: the transports do.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use kvtide_transport::{MemcpyTransport, MemoryKind, Region, Transport};

use super::{parallel, Engine};
use crate::error::Error;

/// Where a region list's bytes go through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Route {
    /// Host memory only: CPU copies.
    Host,
    /// Some GPU memory: the GPU transport.
    Gpu,
}

impl Route {
    pub(crate) const ALL: [Route; 2] = [Route::Host, Route::Gpu];

    /// The route of a region list.
    pub(crate) fn of(regions: &[Region<'_>]) -> Route {
        if regions.iter().any(|r| matches!(r.kind(), MemoryKind::Device { .. })) {
            Route::Gpu
        } else {
            Route::Host
        }
    }
}

/// The transports a call uses, one per route.
#[derive(Clone)]
pub(crate) struct Transports {
    host: Arc<dyn Transport>,
    /// `host` is the store's own CPU copy (no caller transport): host slots may be copied
    /// where they are planned, without a submission.
    host_is_memcpy: bool,
    gpu: Option<Arc<dyn Transport>>,
}

impl Engine {
    /// The transports for region lists of these routes (the GPU transport is only set up when
    /// some list needs it). `host` replaces CPU copies (a paced transport in benchmarks).
    pub(crate) fn transports(&self, routes: &[Route], host: Option<Arc<dyn Transport>>) -> Transports {
        self.transports_via(routes, host, None)
    }

    /// `transports`, with `gpu` in place of the store's GPU transport when given.
    pub(crate) fn transports_via(
        &self,
        routes: &[Route],
        host: Option<Arc<dyn Transport>>,
        gpu: Option<Arc<dyn Transport>>,
    ) -> Transports {
        Transports {
            host_is_memcpy: host.is_none(),
            host: host.unwrap_or_else(|| Arc::new(MemcpyTransport)),
            gpu: routes.contains(&Route::Gpu).then(|| gpu.unwrap_or_else(|| self.gpu.transport(&self.arena))),
        }
    }

    /// Checks region lists on their routes: `lists[i]` with `routes[i]`; `writable` for
    /// destinations. Each list's first error, None when it passed.
    pub(crate) fn check_lists(
        &self,
        transports: &Transports,
        lists: &[&[Region<'_>]],
        routes: &[Route],
        writable: bool,
    ) -> Vec<Option<Error>> {
        let mut out: Vec<Option<Error>> = vec![None; lists.len()];
        // One route for every list (the usual batch): no per-route lists of indices and lists.
        if let Some(&route) = routes.first().filter(|&&first| routes.iter().all(|&r| r == first)) {
            // A large call's lists are checked over a few threads.
            let checked = if route == Route::Host && transports.host_is_memcpy() {
                // The store's own memcpy transport checks each list with `check_host_list`.
                parallel::map_chunks(
                    lists,
                    |list| list.len(),
                    |chunk, _| {
                        chunk.iter().map(|list| kvtide_transport::memcpy::check_host_list(list, writable)).collect()
                    },
                )
            } else {
                let transport = transports.get(route);
                parallel::map_chunks(lists, |list| list.len(), |chunk, _| transport.check(chunk, writable))
            };
            for (error, checked) in out.iter_mut().zip(checked) {
                *error = checked.map(Error::from);
            }
            return out;
        }
        for route in Route::ALL {
            let which: Vec<usize> = (0..lists.len()).filter(|&i| routes[i] == route).collect();
            if which.is_empty() {
                continue;
            }
            let picked: Vec<&[Region<'_>]> = which.iter().map(|&i| lists[i]).collect();
            for (i, error) in which.into_iter().zip(transports.get(route).check(&picked, writable)) {
                out[i] = error.map(Error::from);
            }
        }
        out
    }
}

impl Transports {
    /// True when host routes copy with the store's own `MemcpyTransport`.
    pub(crate) fn host_is_memcpy(&self) -> bool {
        self.host_is_memcpy
    }

    pub(crate) fn get(&self, route: Route) -> &dyn Transport {
        match (route, &self.gpu) {
            (Route::Gpu, Some(gpu)) => gpu.as_ref(),
            _ => self.host.as_ref(),
        }
    }
}

/// Keeps every shard polling instead of parking while an asynchronous transfer is in flight
/// (`gpu_keep_shards_awake`): its release and the caller's next request then cost no wake-up.
/// Made before the call takes leases, dropped after it released them.
pub(crate) struct KeepAwake(Option<Arc<AtomicUsize>>);

impl KeepAwake {
    /// Keeps the shards awake while a call that uses `routes` runs (GPU routes only).
    pub(crate) fn new(engine: &Engine, routes: &[Route]) -> KeepAwake {
        let counter = (engine.config.gpu_keep_shards_awake && routes.contains(&Route::Gpu))
            .then(|| Arc::clone(&engine.keep_awake));
        if let Some(counter) = &counter {
            counter.fetch_add(1, Relaxed);
        }
        KeepAwake(counter)
    }
}

impl Drop for KeepAwake {
    fn drop(&mut self) {
        if let Some(counter) = &self.0 {
            counter.fetch_sub(1, Relaxed);
        }
    }
}
