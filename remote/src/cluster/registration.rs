//! An owner's membership: its record under `/kvtide/<cluster>/owners/<id>`, attached to an etcd
//! lease that a thread keeps alive (every third of the TTL) while the owner runs. Owns the
//! lease, the record's refreshes (capacity and use) and re-registration after the lease was
//! lost (a pause, a partition, etcd restarted without its data); never serves requests. A
//! clean shutdown revokes the lease, so clients drop the owner at once; a crash leaves it to
//! expire after the TTL.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::etcd::{Etcd, EtcdConfig, EtcdError};
use super::member::{self, Member};

/// Default lease TTL: an owner that stops is dropped by clients within this many seconds.
pub const DEFAULT_LEASE_TTL_S: u64 = 5;
/// How often the record's capacity and use are rewritten.
const USAGE_REFRESH: Duration = Duration::from_secs(10);

/// What `kvtide-owner --cluster ...` registers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterConfig {
    pub etcd: EtcdConfig,
    /// Cluster name: members live under `/kvtide/<name>/owners/`.
    pub name: String,
    /// This owner's id (placement hashes on it; keep it across restarts).
    pub id: String,
    /// TCP address clients connect to.
    pub advertise: String,
    pub lease_ttl_s: u64,
}

/// Why an owner could not join its cluster.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClusterError {
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    #[error("invalid cluster setting: {0}")]
    Invalid(String),
    #[error("owner id {id:?} is already registered in cluster {cluster:?} by a live owner at {holder}")]
    AlreadyRegistered { cluster: String, id: String, holder: String },
    #[error(
        "no owner is registered in cluster {cluster:?} (etcd at {endpoints}); is the name right and an owner running?"
    )]
    NoMembers { cluster: String, endpoints: String },
}

/// Membership counters of one owner (exported as `kvtide_cluster_*` metrics).
#[derive(Debug, Default)]
pub struct RegistrationCounters {
    /// 1 while this owner's record is in etcd (as far as it knows), else 0.
    pub registered: AtomicU64,
    pub keepalives: AtomicU64,
    pub keepalive_failures: AtomicU64,
    /// Registrations, the first included: more than 1 means the lease was lost and renewed.
    pub registrations: AtomicU64,
    pub lease_ttl_s: AtomicU64,
}

/// The usage an owner reports in its record: (used bytes, objects, SSD bytes).
pub type UsageFn = Box<dyn Fn() -> (u64, u64, u64) + Send>;

/// A registered owner; dropping it (or `shutdown`) revokes the lease.
pub struct Registration {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
    counters: Arc<RegistrationCounters>,
    member: Member,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration").field("member", &self.member).finish_non_exhaustive()
    }
}

/// What the keep-alive thread owns.
struct Keeper {
    etcd: Etcd,
    key: Vec<u8>,
    member: Member,
    ttl_s: u64,
    lease: i64,
    usage: UsageFn,
    counters: Arc<RegistrationCounters>,
}

impl Keeper {
    fn record(&mut self) -> Vec<u8> {
        let (used, objects, ssd) = (self.usage)();
        (self.member.used_bytes, self.member.objects, self.member.ssd_bytes) = (used, objects, ssd);
        serde_json::to_vec(&self.member).unwrap_or_default()
    }

    /// Takes a new lease and writes the record under it, unless another live owner holds the id.
    fn register(&mut self, wait_for_previous: Duration) -> Result<(), ClusterError> {
        let (lease, granted) = self.etcd.grant(self.ttl_s)?;
        self.counters.lease_ttl_s.store(u64::try_from(granted).unwrap_or(0), Ordering::Relaxed);
        let deadline = Instant::now() + wait_for_previous;
        loop {
            let record = self.record();
            if self.etcd.create(&self.key, &record, lease)? {
                break;
            }
            // Our own earlier record (this process, lease lost and key still there) is ours to
            // replace; another process's must expire first (a crash leaves it for one TTL).
            let existing = self.etcd.get(&self.key)?;
            let holder = existing
                .as_ref()
                .and_then(|kv| serde_json::from_slice::<Member>(&kv.value).ok())
                .map(|m| (m.generation == self.member.generation && m.tcp == self.member.tcp, m.tcp));
            match holder {
                Some((true, _)) => {
                    self.etcd.put(&self.key, &record, lease)?;
                    break;
                }
                Some((false, tcp)) if Instant::now() >= deadline => {
                    let _ = self.etcd.revoke(lease);
                    return Err(ClusterError::AlreadyRegistered {
                        cluster: String::new(),
                        id: self.member.id.clone(),
                        holder: tcp,
                    });
                }
                None if Instant::now() >= deadline => {
                    // Garbage under our key and no one keeps it alive: take the key over.
                    self.etcd.put(&self.key, &record, lease)?;
                    break;
                }
                _ => std::thread::sleep(Duration::from_millis(200)),
            }
        }
        self.lease = lease;
        self.counters.registrations.fetch_add(1, Ordering::Relaxed);
        self.counters.registered.store(1, Ordering::Relaxed);
        Ok(())
    }

    fn run(mut self, stop: Arc<(Mutex<bool>, Condvar)>) {
        let interval = Duration::from_millis((self.ttl_s * 1000 / 3).max(200));
        let mut last_usage = Instant::now();
        let mut failing_since: Option<Instant> = None;
        let (lock, cv) = &*stop;
        loop {
            {
                let stopped = lock.lock().unwrap_or_else(|p| p.into_inner());
                let (stopped, _) = cv.wait_timeout_while(stopped, interval, |s| !*s).unwrap_or_else(|p| p.into_inner());
                if *stopped {
                    break;
                }
            }
            let outcome = match self.etcd.keep_alive(self.lease) {
                Ok(Some(_)) => {
                    self.counters.keepalives.fetch_add(1, Ordering::Relaxed);
                    if last_usage.elapsed() >= USAGE_REFRESH {
                        last_usage = Instant::now();
                        let record = self.record();
                        self.etcd.put(&self.key, &record, self.lease).map_err(ClusterError::from)
                    } else {
                        Ok(())
                    }
                }
                Ok(None) => {
                    // The lease expired (this process paused, or etcd was unreachable too long):
                    // the record is gone; register again.
                    self.counters.registered.store(0, Ordering::Relaxed);
                    tracing::warn!(id = %self.member.id, "cluster lease lost; registering again");
                    self.register(Duration::from_secs(self.ttl_s + 2))
                }
                Err(e) => Err(e.into()),
            };
            match outcome {
                Ok(()) => {
                    if let Some(since) = failing_since.take() {
                        tracing::info!(
                            failed_for_ms = since.elapsed().as_millis() as u64,
                            "cluster keep-alive works again"
                        );
                    }
                }
                Err(e) => {
                    self.counters.keepalive_failures.fetch_add(1, Ordering::Relaxed);
                    if failing_since.is_none() {
                        failing_since = Some(Instant::now());
                        tracing::warn!(error = %e, "cluster keep-alive failed; retrying");
                    }
                    if failing_since.is_some_and(|t| t.elapsed() > Duration::from_secs(self.ttl_s)) {
                        self.counters.registered.store(0, Ordering::Relaxed);
                    }
                }
            }
        }
        if let Err(e) = self.etcd.revoke(self.lease) {
            tracing::warn!(error = %e, "could not revoke the cluster lease; the record expires with it");
        }
        self.counters.registered.store(0, Ordering::Relaxed);
    }
}

impl Registration {
    /// Registers `member` in `config`'s cluster and keeps it registered until dropped. A record
    /// under the same id that another process keeps alive is waited for (one TTL: a crashed
    /// predecessor's lease expires), then refused.
    pub fn start(
        config: &ClusterConfig,
        mut member: Member,
        usage: UsageFn,
        counters: Arc<RegistrationCounters>,
    ) -> Result<Registration, ClusterError> {
        member::check_name("cluster name", &config.name).map_err(ClusterError::Invalid)?;
        member::check_name("owner id", &config.id).map_err(ClusterError::Invalid)?;
        member::check_address(&config.advertise).map_err(ClusterError::Invalid)?;
        if !(1..=3600).contains(&config.lease_ttl_s) {
            return Err(ClusterError::Invalid(format!("lease TTL {} s is not within 1..=3600", config.lease_ttl_s)));
        }
        member.id = config.id.clone();
        member.tcp = config.advertise.clone();
        member.generation = SystemTime::now().duration_since(UNIX_EPOCH).map_or(1, |d| d.as_millis() as u64);
        let etcd = Etcd::new(config.etcd.clone())?;
        let key = format!("{}{}", member::members_prefix(&config.name), config.id).into_bytes();
        let mut keeper = Keeper {
            etcd,
            key,
            member: member.clone(),
            ttl_s: config.lease_ttl_s,
            lease: 0,
            usage,
            counters: Arc::clone(&counters),
        };
        keeper.register(Duration::from_secs(config.lease_ttl_s + 2)).map_err(|e| match e {
            ClusterError::AlreadyRegistered { id, holder, .. } => {
                ClusterError::AlreadyRegistered { cluster: config.name.clone(), id, holder }
            }
            other => other,
        })?;
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let thread_stop = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("kvtide-cluster".into())
            .spawn(move || keeper.run(thread_stop))
            .map_err(|e| ClusterError::Invalid(format!("cannot start the keep-alive thread: {e}")))?;
        Ok(Registration { stop, thread: Some(thread), counters, member })
    }

    /// The record as registered (usage as of the start).
    pub fn member(&self) -> &Member {
        &self.member
    }

    pub fn counters(&self) -> &RegistrationCounters {
        &self.counters
    }

    /// Revokes the lease: clients drop this owner at once.
    pub fn shutdown(mut self) {
        self.stop_thread();
    }

    fn stop_thread(&mut self) {
        let (lock, cv) = &*self.stop;
        *lock.lock().unwrap_or_else(|p| p.into_inner()) = true;
        cv.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.stop_thread();
    }
}
