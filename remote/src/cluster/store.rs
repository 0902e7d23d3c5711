//! `ClusterStore`: a `Store` over every owner registered in one etcd cluster. Owns the
//! following of the membership (re-read from etcd every `refresh_ms`, the last good view kept
//! while etcd is away; the view itself, with each member's health and connection, is
//! `view.rs`'s), the routing of each key to its rendezvous-ranked members, and the per-key
//! merging of their answers. Never stores data itself, never asks etcd on the data path, and
//! takes no client-wide mutex there: a call reads the current view (an `Arc` behind a read
//! lock) and each member's health and connection from the view's per-member `Link`.
//!
//! Routing:
//! - a put goes to the key's first `replication` reachable members, in parallel per member, and
//!   is acknowledged only when all of them acknowledged it; an upsert also removes the key from
//!   the other reachable members, so an older copy left by a membership change cannot return;
//! - a read asks the key's members in rank order until one has it or `replication` of them
//!   answered that they do not (a miss); a member that fails is marked down for `retry_ms` and
//!   the next one is asked;
//! - removes go to every reachable member; pins to the key's replicas;
//! - scans walk the members in id order, each key reported by the first-ranked member that
//!   holds it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use kvtide::{BatchTicket, Error as StoreError, Fragment, KeyPage, PutOptions, Region, Stats, Store};

use super::etcd::{Etcd, EtcdConfig};
use super::member::{self, Member};
use super::registration::ClusterError;
use super::view::View;
use crate::client::{lists_per_key, submit_batch_get, CancellableRead, ClientOptions, RemoteStore};
use crate::error::{Error, Result};

/// Most replicas of one key.
pub const MAX_REPLICATION: usize = 8;
/// Members one cluster view holds at most (the scan cursor keeps the member's position in 16
/// bits).
const MAX_MEMBERS: usize = 4096;

/// How a `ClusterStore` finds its owners and routes to them.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    pub etcd: EtcdConfig,
    /// The cluster's name (`kvtide-owner --cluster-name`).
    pub name: String,
    /// Members each key is stored on (1 to 8, default 1).
    pub replication: usize,
    /// Options of the connection to each owner (token, timeouts, shared memory).
    pub client: ClientOptions,
    /// How often the membership is re-read from etcd. Default 500 ms.
    pub refresh_ms: u64,
    /// How long a member that failed a request is skipped before it is tried again. Default 1 s.
    pub retry_ms: u64,
    /// How long `connect` waits for a first member to register. Default 0 (none: an empty
    /// cluster is an error).
    pub wait_for_members_ms: u64,
    /// Reach owners on this host by their Unix socket (shared memory). Default true; false
    /// uses TCP for every owner.
    pub unix_on_same_host: bool,
}

impl ClusterOptions {
    /// Options for the cluster `name` on the etcd endpoints `etcd` (`etcd://HOST:PORT,...`).
    pub fn new(etcd: &str, name: &str) -> std::result::Result<ClusterOptions, ClusterError> {
        Ok(ClusterOptions {
            etcd: EtcdConfig::parse(etcd)?,
            name: name.to_string(),
            replication: 1,
            client: ClientOptions::default(),
            refresh_ms: 500,
            retry_ms: 1000,
            wait_for_members_ms: 0,
            unix_on_same_host: true,
        })
    }
}

/// Routing counters of one `ClusterStore`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RoutingStats {
    /// Members in the current view, and entries skipped as invalid.
    pub members: u64,
    pub invalid_members: u64,
    /// Times the view changed, etcd reads that failed (the last view was kept).
    pub membership_changes: u64,
    pub membership_errors: u64,
    /// Per-member requests sent, and keys (or fragments) they carried.
    pub member_requests: u64,
    pub keys_routed: u64,
    /// Requests that failed because a member was unreachable (it was marked down).
    pub member_failures: u64,
    /// Keys asked of another member after a member failed or missed.
    pub failovers: u64,
    /// Reads that found their key on a replica after the first-ranked member missed.
    pub replica_hits: u64,
    /// Puts placed on a member beyond their first-ranked ones because one was down.
    pub puts_rerouted: u64,
}

#[derive(Default)]
struct Counters {
    membership_changes: AtomicU64,
    membership_errors: AtomicU64,
    member_requests: AtomicU64,
    keys_routed: AtomicU64,
    member_failures: AtomicU64,
    failovers: AtomicU64,
    replica_hits: AtomicU64,
    puts_rerouted: AtomicU64,
}

struct Inner {
    options: ClusterOptions,
    etcd: Etcd,
    prefix: String,
    host: String,
    view: RwLock<Arc<View>>,
    counters: Counters,
    tickets_in_flight: Arc<AtomicU64>,
    stop: Arc<(Mutex<bool>, Condvar)>,
}

/// A store over a kvtide cluster. Cheap to share; every method takes `&self`.
pub struct ClusterStore {
    inner: Arc<Inner>,
    refresher: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for ClusterStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterStore").field("cluster", &self.inner.options.name).finish_non_exhaustive()
    }
}

/// One request to one member: the store and the indices of the items it carries; one result
/// per item.
type MemberCall<'a, T> = dyn Fn(&RemoteStore, &[usize]) -> Vec<Result<T>> + Sync + 'a;

/// True when `e` says the member could not serve (as opposed to an answer about the key).
fn member_failed(e: &Error) -> bool {
    matches!(e, Error::Disconnected(_) | Error::Timeout { .. } | Error::Store(StoreError::ShuttingDown))
}

fn no_member(cluster: &str) -> Error {
    Error::Disconnected(format!("no reachable owner of cluster {cluster:?} for this key"))
}

impl ClusterStore {
    /// Reads the membership of `options.name` from etcd and starts following it. Errors: etcd
    /// unreachable, an invalid name or option, no member registered (after
    /// `wait_for_members_ms`).
    pub fn connect(options: ClusterOptions) -> std::result::Result<ClusterStore, ClusterError> {
        member::check_name("cluster name", &options.name).map_err(ClusterError::Invalid)?;
        if !(1..=MAX_REPLICATION).contains(&options.replication) {
            return Err(ClusterError::Invalid(format!(
                "replication {} is not within 1..={MAX_REPLICATION}",
                options.replication
            )));
        }
        if options.refresh_ms == 0 || options.refresh_ms > 600_000 {
            return Err(ClusterError::Invalid(format!("refresh_ms {} is not within 1..=600000", options.refresh_ms)));
        }
        let etcd = Etcd::new(options.etcd.clone())?;
        let prefix = member::members_prefix(&options.name);
        let inner = Arc::new(Inner {
            etcd,
            prefix,
            host: member::host_identity(),
            view: RwLock::new(Arc::new(View::default())),
            counters: Counters::default(),
            tickets_in_flight: Arc::new(AtomicU64::new(0)),
            stop: Arc::new((Mutex::new(false), Condvar::new())),
            options,
        });
        let deadline = Instant::now() + Duration::from_millis(inner.options.wait_for_members_ms);
        loop {
            inner.refresh()?;
            if !inner.view().members.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                return Err(ClusterError::NoMembers {
                    cluster: inner.options.name.clone(),
                    endpoints: inner.etcd.endpoints(),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let weak = Arc::downgrade(&inner);
        let stop = Arc::clone(&inner.stop);
        let interval = Duration::from_millis(inner.options.refresh_ms);
        let refresher = std::thread::Builder::new()
            .name("kvtide-cluster-view".into())
            .spawn(move || follow(weak, stop, interval))
            .map_err(|e| ClusterError::Invalid(format!("cannot start the membership thread: {e}")))?;
        Ok(ClusterStore { inner, refresher: Some(refresher) })
    }

    /// The members in the current view (sorted by id).
    pub fn members(&self) -> Vec<Member> {
        self.inner.view().members.clone()
    }

    /// Entries under the cluster's prefix that are not valid member records: (key, why).
    pub fn invalid_members(&self) -> Vec<(String, String)> {
        self.inner.view().invalid.clone()
    }

    /// The ids of the members `key` is placed on now, first-ranked first (down members
    /// included).
    pub fn placement(&self, key: &[u8]) -> Vec<String> {
        let view = self.inner.view();
        let r = self.inner.options.replication;
        view.rank(key).into_iter().take(r).map(|i| view.members[i].id.clone()).collect()
    }

    /// The connection to the first reachable member `key` is placed on: for single-key
    /// operations beyond `Store` (progressive reads and puts), which go to that member alone.
    pub fn owner_of(&self, key: &[u8]) -> Result<Arc<RemoteStore>> {
        let inner = &self.inner;
        let view = inner.view();
        for m in view.rank(key) {
            if view.is_down(m) {
                continue;
            }
            match inner.connection(&view, m) {
                Ok(store) => return Ok(Arc::clone(store)),
                Err(e) if member_failed(&e) => inner.mark_down(&view, m, &e),
                Err(e) => return Err(e),
            }
        }
        Err(no_member(&inner.options.name))
    }

    /// Members each key is stored on.
    pub fn replication(&self) -> usize {
        self.inner.options.replication
    }

    /// The largest value every reachable member stores.
    pub fn max_value_bytes(&self) -> Result<u64> {
        let view = self.inner.view();
        let groups: Vec<(usize, Vec<usize>)> = (0..view.members.len()).map(|m| (m, vec![0])).collect();
        let call = |store: &RemoteStore, _: &[usize]| vec![store.max_value_bytes()];
        let answers: Vec<u64> =
            self.inner.fan_out(&view, &groups, &call).into_iter().flatten().filter_map(|r| r.ok()).collect();
        answers.into_iter().min().ok_or_else(|| no_member(&self.inner.options.name))
    }

    /// Reads the membership from etcd now (it is also read every `refresh_ms`).
    pub fn refresh(&self) -> std::result::Result<(), ClusterError> {
        self.inner.refresh()
    }

    pub fn routing(&self) -> RoutingStats {
        let c = &self.inner.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let view = self.inner.view();
        RoutingStats {
            members: view.members.len() as u64,
            invalid_members: view.invalid.len() as u64,
            membership_changes: r(&c.membership_changes),
            membership_errors: r(&c.membership_errors),
            member_requests: r(&c.member_requests),
            keys_routed: r(&c.keys_routed),
            member_failures: r(&c.member_failures),
            failovers: r(&c.failovers),
            replica_hits: r(&c.replica_hits),
            puts_rerouted: r(&c.puts_rerouted),
        }
    }
}

impl Drop for ClusterStore {
    fn drop(&mut self) {
        // Only the store `connect` returned follows the membership (a ticket's copy does not).
        if let Some(t) = self.refresher.take() {
            let (lock, cv) = &*self.inner.stop;
            *lock.lock().unwrap_or_else(|p| p.into_inner()) = true;
            cv.notify_all();
            let _ = t.join();
        }
    }
}

/// The membership thread: re-reads etcd every `interval` until the store is dropped.
fn follow(inner: Weak<Inner>, stop: Arc<(Mutex<bool>, Condvar)>, interval: Duration) {
    let (lock, cv) = &*stop;
    let mut failing = false;
    loop {
        {
            let stopped = lock.lock().unwrap_or_else(|p| p.into_inner());
            let (stopped, _) = cv.wait_timeout_while(stopped, interval, |s| !*s).unwrap_or_else(|p| p.into_inner());
            if *stopped {
                return;
            }
        }
        let Some(inner) = inner.upgrade() else { return };
        match inner.refresh() {
            Ok(()) if failing => {
                failing = false;
                tracing::info!(cluster = %inner.options.name, "etcd answers again; membership followed");
            }
            Ok(()) => {}
            Err(e) => {
                if !failing {
                    tracing::warn!(cluster = %inner.options.name, error = %e, "cannot read the membership; keeping the last one");
                }
                failing = true;
            }
        }
    }
}

impl Inner {
    fn view(&self) -> Arc<View> {
        Arc::clone(&self.view.read().unwrap_or_else(|p| p.into_inner()))
    }

    fn refresh(&self) -> std::result::Result<(), ClusterError> {
        let entries = match self.etcd.get_prefix(self.prefix.as_bytes()) {
            Ok(entries) => entries,
            Err(e) => {
                self.counters.membership_errors.fetch_add(1, Ordering::Relaxed);
                return Err(e.into());
            }
        };
        let mut members = Vec::new();
        let mut invalid = Vec::new();
        for kv in entries {
            match member::parse_member(&self.prefix, &kv.key, &kv.value) {
                Ok(m) if members.len() < MAX_MEMBERS => members.push(m),
                Ok(m) => invalid.push((m.id, format!("more than {MAX_MEMBERS} members"))),
                Err(why) => invalid.push((String::from_utf8_lossy(&kv.key).into_owned(), why)),
            }
        }
        members.sort_by(|a, b| a.id.cmp(&b.id));
        let current = self.view();
        let same = current.members.len() == members.len()
            && current
                .members
                .iter()
                .zip(&members)
                .all(|(a, b)| a.id == b.id && a.generation == b.generation && a.tcp == b.tcp);
        if same && current.invalid == invalid {
            if current.members != members {
                // Only usage changed.
                let view = View::new(members, invalid, &current);
                *self.view.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(view);
            }
            return Ok(());
        }
        if !same {
            self.counters.membership_changes.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                cluster = %self.options.name,
                members = ?members.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(),
                "cluster membership changed"
            );
        }
        for (key, why) in invalid.iter().filter(|e| !current.invalid.contains(e)) {
            tracing::warn!(cluster = %self.options.name, %key, %why, "ignoring an invalid member entry");
        }
        // Links of members that left (or restarted) are dropped with the old view: a new
        // generation gets a new connection, and with it a new mapping of its arena.
        let view = View::new(members, invalid, &current);
        *self.view.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(view);
        Ok(())
    }

    fn mark_down(&self, view: &View, m: usize, why: &Error) {
        self.counters.member_failures.fetch_add(1, Ordering::Relaxed);
        if view.links[m].mark_down(self.options.retry_ms) {
            let owner = &view.members[m].id;
            tracing::warn!(cluster = %self.options.name, %owner, error = %why, "owner unreachable; routing around it");
        }
    }

    /// The connection to member `m` of `view`, made on first use.
    fn connection<'v>(&self, view: &'v View, m: usize) -> Result<&'v Arc<RemoteStore>> {
        view.links[m].connection(|| self.open(&view.members[m]))
    }

    fn open(&self, member: &Member) -> Result<RemoteStore> {
        let same_host = self.options.unix_on_same_host && member.host == self.host;
        if let (true, Some(path)) = (same_host, &member.unix_socket) {
            if std::path::Path::new(path).exists() {
                match RemoteStore::connect_with(&format!("unix:{path}"), self.options.client.clone()) {
                    Ok(store) => return Ok(store),
                    Err(e) => tracing::debug!(owner = %member.id, error = %e, "Unix socket refused; using TCP"),
                }
            }
        }
        RemoteStore::connect_with(&member.tcp, self.options.client.clone())
    }

    /// Runs `call` on each member for its group of item indices, the groups in parallel, and
    /// marks a member down when it failed. Returns each group's results in group order.
    fn fan_out<T: Send>(
        &self,
        view: &View,
        groups: &[(usize, Vec<usize>)],
        call: &MemberCall<'_, T>,
    ) -> Vec<Vec<Result<T>>> {
        let one = |(m, items): &(usize, Vec<usize>)| -> Vec<Result<T>> {
            self.counters.member_requests.fetch_add(1, Ordering::Relaxed);
            self.counters.keys_routed.fetch_add(items.len() as u64, Ordering::Relaxed);
            let results = match self.connection(view, *m) {
                Ok(store) => call(store, items),
                Err(e) => items.iter().map(|_| Err(e.clone())).collect(),
            };
            if let Some(e) = results.iter().find_map(|r| r.as_ref().err().filter(|e| member_failed(e))) {
                self.mark_down(view, *m, e);
            }
            results
        };
        match groups {
            [] => Vec::new(),
            [only] => vec![one(only)],
            [first, rest @ ..] => std::thread::scope(|s| {
                let handles: Vec<_> = rest.iter().map(|g| s.spawn(move || one(g))).collect();
                let mut all = vec![one(first)];
                for (h, g) in handles.into_iter().zip(rest) {
                    all.push(h.join().unwrap_or_else(|_| {
                        g.1.iter().map(|_| Err(StoreError::Internal("a member request panicked").into())).collect()
                    }));
                }
                all
            }),
        }
    }

    /// Reads: asks each item's members in rank order (skipping members marked down) until one
    /// answers with something other than a miss, or `replication` members missed. `keys[i]` is
    /// item i's key; `is_miss` says whether an answer is a miss.
    fn read<T: Send>(
        &self,
        keys: &[&[u8]],
        call: &MemberCall<'_, T>,
        is_miss: &dyn Fn(&Result<T>) -> bool,
    ) -> Vec<Result<T>> {
        let view = self.view();
        let cluster = &self.options.name;
        let mut results: Vec<Option<Result<T>>> = keys.iter().map(|_| None).collect();
        let ranks: Vec<Vec<usize>> = keys.iter().map(|k| view.rank(k)).collect();
        let mut next = vec![0usize; keys.len()];
        let mut misses = vec![0usize; keys.len()];
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        while !pending.is_empty() {
            let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
            for &i in &pending {
                let member = loop {
                    match ranks[i].get(next[i]) {
                        Some(&m) if view.is_down(m) => next[i] += 1,
                        other => break other.copied(),
                    }
                };
                match member {
                    Some(m) if misses[i] < self.options.replication => {
                        next[i] += 1;
                        match groups.iter_mut().find(|g| g.0 == m) {
                            Some(g) => g.1.push(i),
                            None => groups.push((m, vec![i])),
                        }
                    }
                    _ => {
                        if results[i].is_none() {
                            results[i] = Some(Err(no_member(cluster)));
                        }
                    }
                }
            }
            let answers = self.fan_out(&view, &groups, call);
            pending.clear();
            for ((_, items), answers) in groups.iter().zip(answers) {
                for (&i, answer) in items.iter().zip(answers) {
                    let retry = match &answer {
                        Err(e) if member_failed(e) => true,
                        a if is_miss(a) => {
                            misses[i] += 1;
                            misses[i] < self.options.replication
                        }
                        _ => {
                            if misses[i] > 0 {
                                self.counters.replica_hits.fetch_add(1, Ordering::Relaxed);
                            }
                            false
                        }
                    };
                    if retry {
                        self.counters.failovers.fetch_add(1, Ordering::Relaxed);
                        pending.push(i);
                    }
                    // A miss after a failure is the better answer: the key is not reachable.
                    if !(retry && results[i].as_ref().is_some_and(is_miss)) {
                        results[i] = Some(answer);
                    }
                }
            }
        }
        results.into_iter().map(|r| r.unwrap_or_else(|| Err(no_member(cluster)))).collect()
    }

    /// The first `replication` members of each key that are not marked down (puts and pins).
    fn replicas(&self, view: &View, key: &[u8]) -> Vec<usize> {
        let r = self.options.replication;
        let ranked = view.rank(key);
        let live: Vec<usize> = ranked.iter().copied().filter(|&m| !view.is_down(m)).take(r).collect();
        if live.iter().zip(&ranked).any(|(a, b)| a != b) {
            self.counters.puts_rerouted.fetch_add(1, Ordering::Relaxed);
        }
        live
    }

    /// Writes: `call` on every (key, member) pair of `targets` (key i goes to `targets[i]`); a
    /// member that fails during the call is replaced by the key's next reachable member. Key i
    /// succeeds when every target acknowledged it; its result is otherwise the first error.
    fn write_all(
        &self,
        view: &View,
        keys: &[&[u8]],
        mut targets: Vec<Vec<usize>>,
        call: &MemberCall<'_, ()>,
        replace_failed: bool,
    ) -> Vec<Result<()>> {
        let cluster = &self.options.name;
        let mut results: Vec<Result<()>> =
            targets.iter().map(|t| if t.is_empty() { Err(no_member(cluster)) } else { Ok(()) }).collect();
        let mut tried: Vec<Vec<usize>> = targets.clone();
        loop {
            let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
            for (i, t) in targets.iter().enumerate() {
                for &m in t {
                    match groups.iter_mut().find(|g| g.0 == m) {
                        Some(g) => g.1.push(i),
                        None => groups.push((m, vec![i])),
                    }
                }
            }
            if groups.is_empty() {
                return results;
            }
            let answers = self.fan_out(view, &groups, call);
            let mut again: Vec<Vec<usize>> = vec![Vec::new(); keys.len()];
            for ((_, items), answers) in groups.iter().zip(answers) {
                for (&i, answer) in items.iter().zip(answers) {
                    match answer {
                        Ok(()) => {}
                        Err(e) if member_failed(&e) && replace_failed => {
                            // The next reachable member not tried yet takes this replica.
                            let next =
                                view.rank(keys[i]).into_iter().find(|m| !tried[i].contains(m) && !view.is_down(*m));
                            match next {
                                Some(m) => {
                                    self.counters.failovers.fetch_add(1, Ordering::Relaxed);
                                    tried[i].push(m);
                                    again[i].push(m);
                                }
                                None => {
                                    if results[i].is_ok() {
                                        results[i] = Err(e);
                                    }
                                }
                            }
                        }
                        Err(e) => {
                            if results[i].is_ok() {
                                results[i] = Err(e);
                            }
                        }
                    }
                }
            }
            targets = again;
        }
    }
}

fn key_list<'k>(keys: &[&'k [u8]], items: &[usize]) -> Vec<&'k [u8]> {
    items.iter().map(|&i| keys[i]).collect()
}

fn is_not_found<T>(r: &Result<T>) -> bool {
    matches!(r, Err(Error::Store(StoreError::NotFound)))
}

impl Store for ClusterStore {
    type Error = Error;

    fn batch_put_from_multi_buffers(
        &self,
        keys: &[&[u8]],
        sources: &[Vec<Region<'_>>],
        opts: PutOptions,
    ) -> Vec<Result<()>> {
        if let Err(refused) = lists_per_key(keys.len(), sources.len(), "source") {
            return refused;
        }
        let inner = &self.inner;
        let view = inner.view();
        let targets: Vec<Vec<usize>> = keys.iter().map(|k| inner.replicas(&view, k)).collect();
        let put = |store: &RemoteStore, items: &[usize]| {
            let sub: Vec<Vec<Region<'_>>> = items.iter().map(|&i| sources[i].clone()).collect();
            store.batch_put_from_multi_buffers(&key_list(keys, items), &sub, opts)
        };
        let mut results = inner.write_all(&view, keys, targets.clone(), &put, true);
        if opts.upsert {
            // Older copies on members that held the key under an earlier membership.
            let others: Vec<Vec<usize>> = (0..keys.len())
                .map(|i| {
                    if results[i].is_err() {
                        return Vec::new();
                    }
                    (0..view.members.len()).filter(|m| !targets[i].contains(m) && !view.is_down(*m)).collect()
                })
                .collect();
            let remove = |store: &RemoteStore, items: &[usize]| {
                store
                    .batch_remove(&key_list(keys, items), true)
                    .into_iter()
                    .map(|r| if is_not_found(&r) { Ok(()) } else { r })
                    .collect()
            };
            // A member that fails here is marked down, and its copy stays unreachable.
            let cleared = inner.write_all(&view, keys, others, &remove, false);
            for (r, cleared) in results.iter_mut().zip(cleared) {
                if let (Ok(()), Err(e)) = (&*r, cleared) {
                    if !member_failed(&e) {
                        *r = Err(e);
                    }
                }
            }
        }
        results
    }

    fn get(&self, key: &[u8]) -> Result<Vec<u8>> {
        let keys = [key];
        let call = |store: &RemoteStore, items: &[usize]| items.iter().map(|_| store.get(key)).collect();
        self.inner
            .read(&keys, &call, &is_not_found)
            .pop()
            .unwrap_or_else(|| Err(StoreError::Internal("no result").into()))
    }

    fn get_into(&self, key: &[u8], dst: Region<'_>) -> Result<usize> {
        let keys = [key];
        let call = |store: &RemoteStore, items: &[usize]| items.iter().map(|_| store.get_into(key, dst)).collect();
        self.inner
            .read(&keys, &call, &is_not_found)
            .pop()
            .unwrap_or_else(|| Err(StoreError::Internal("no result").into()))
    }

    fn batch_get_into(&self, keys: &[&[u8]], dsts: &[Region<'_>]) -> Vec<Result<usize>> {
        if let Err(refused) = lists_per_key(keys.len(), dsts.len(), "destination") {
            return refused;
        }
        let call = |store: &RemoteStore, items: &[usize]| {
            let sub: Vec<Region<'_>> = items.iter().map(|&i| dsts[i]).collect();
            store.batch_get_into(&key_list(keys, items), &sub)
        };
        self.inner.read(keys, &call, &is_not_found)
    }

    fn batch_get_into_multi_buffers(&self, keys: &[&[u8]], dsts: &[Vec<Region<'_>>]) -> Vec<Result<usize>> {
        self.batch_get_cancellable(keys, dsts, None)
    }

    fn get_into_ranges(&self, buffers: &[Region<'_>], fragments: &[Vec<Fragment>]) -> Vec<Vec<Result<usize>>> {
        if let Err(e) = kvtide::checks::one_list_per_key(buffers.len(), fragments.len(), "fragment") {
            let e = Error::from(e);
            return fragments.iter().map(|f| f.iter().map(|_| Err(e.clone())).collect()).collect();
        }
        // Items are fragments, flattened buffer-major; each member gets the buffers whole and
        // only its own fragments.
        let flat: Vec<(usize, &Fragment)> =
            fragments.iter().enumerate().flat_map(|(b, fs)| fs.iter().map(move |f| (b, f))).collect();
        let keys: Vec<&[u8]> = flat.iter().map(|(_, f)| f.key.as_slice()).collect();
        let call = |store: &RemoteStore, items: &[usize]| {
            let mut per_buffer: Vec<Vec<Fragment>> = vec![Vec::new(); buffers.len()];
            let mut order: Vec<(usize, usize)> = Vec::with_capacity(items.len());
            for &i in items {
                let (b, f) = flat[i];
                order.push((b, per_buffer[b].len()));
                per_buffer[b].push(f.clone());
            }
            let answers = store.get_into_ranges(buffers, &per_buffer);
            order
                .into_iter()
                .map(|(b, j)| {
                    answers
                        .get(b)
                        .and_then(|a| a.get(j))
                        .cloned()
                        .unwrap_or_else(|| Err(StoreError::Internal("missing fragment result").into()))
                })
                .collect()
        };
        let mut results = self.inner.read(&keys, &call, &is_not_found).into_iter();
        fragments
            .iter()
            .map(|fs| {
                fs.iter()
                    .map(|_| results.next().unwrap_or_else(|| Err(StoreError::Internal("no result").into())))
                    .collect()
            })
            .collect()
    }

    fn batch_exists(&self, keys: &[&[u8]]) -> Vec<Result<bool>> {
        let call = |store: &RemoteStore, items: &[usize]| store.batch_exists(&key_list(keys, items));
        self.inner.read(keys, &call, &|r| matches!(r, Ok(false)))
    }

    fn remove(&self, key: &[u8], force: bool) -> Result<()> {
        self.batch_remove(&[key], force).pop().unwrap_or_else(|| Err(StoreError::Internal("no result").into()))
    }

    fn batch_remove(&self, keys: &[&[u8]], force: bool) -> Vec<Result<()>> {
        let inner = &self.inner;
        let view = inner.view();
        // Every reachable member: a copy left by an earlier membership must go too.
        let live: Vec<usize> = (0..view.members.len()).filter(|&m| !view.is_down(m)).collect();
        let groups: Vec<(usize, Vec<usize>)> = live.iter().map(|&m| (m, (0..keys.len()).collect())).collect();
        let call = |store: &RemoteStore, items: &[usize]| store.batch_remove(&key_list(keys, items), force);
        let answers = inner.fan_out(&view, &groups, &call);
        let mut results: Vec<Result<()>> = keys.iter().map(|_| Err(StoreError::NotFound.into())).collect();
        let mut reached = vec![false; keys.len()];
        for answers in answers {
            for (i, answer) in answers.into_iter().enumerate() {
                match answer {
                    Err(e) if member_failed(&e) => {}
                    Err(e) if is_not_found::<()>(&Err(e.clone())) => reached[i] = true,
                    Ok(()) => {
                        reached[i] = true;
                        if is_not_found(&results[i]) {
                            results[i] = Ok(());
                        }
                    }
                    Err(e) => {
                        reached[i] = true;
                        results[i] = Err(e);
                    }
                }
            }
        }
        for (r, reached) in results.iter_mut().zip(reached) {
            if !reached {
                *r = Err(no_member(&inner.options.name));
            }
        }
        results
    }

    fn scan_keys(&self, prefix: &[u8], cursor: u64, limit: usize) -> Result<KeyPage> {
        let view = self.inner.view();
        let (position, inner_cursor) = ((cursor >> 48) as usize, cursor & ((1 << 48) - 1));
        let Some(member) = view.members.get(position) else {
            return Err(StoreError::InvalidArgument(format!("scan cursor {cursor:#x} names no member")).into());
        };
        let store = self.inner.connection(&view, position).inspect_err(|e| {
            if member_failed(e) {
                self.inner.mark_down(&view, position, e);
            }
        })?;
        let page = store.scan_keys(prefix, inner_cursor, limit)?;
        // Report each key from its first-ranked member that holds it: ask the members ranked
        // above this one.
        let mut keep = vec![true; page.keys.len()];
        let mut above: Vec<(usize, Vec<usize>)> = Vec::new();
        for (i, key) in page.keys.iter().enumerate() {
            for m in view.rank(key).into_iter().take_while(|&m| m != position) {
                match above.iter_mut().find(|g| g.0 == m) {
                    Some(g) => g.1.push(i),
                    None => above.push((m, vec![i])),
                }
            }
        }
        let keys: Vec<&[u8]> = page.keys.iter().map(Vec::as_slice).collect();
        let call = |store: &RemoteStore, items: &[usize]| store.batch_exists(&key_list(&keys, items));
        for ((_, items), answers) in above.iter().zip(self.inner.fan_out(&view, &above, &call)) {
            for (&i, answer) in items.iter().zip(answers) {
                if matches!(answer, Ok(true)) {
                    keep[i] = false;
                }
            }
        }
        let keys = page.keys.into_iter().zip(keep).filter_map(|(k, keep)| keep.then_some(k)).collect();
        let next = match page.cursor {
            Some(c) if c >> 48 == 0 => Some(((position as u64) << 48) | c),
            Some(c) => {
                return Err(Error::Protocol(format!(
                    "owner {} returned a scan cursor of more than 48 bits ({c:#x})",
                    member.id
                )))
            }
            None => (position + 1 < view.members.len()).then(|| (position as u64 + 1) << 48),
        };
        Ok(KeyPage { keys, cursor: next })
    }

    fn pin(&self, key: &[u8]) -> Result<()> {
        self.on_replicas(key, &|store| store.pin(key))
    }

    fn unpin(&self, key: &[u8]) -> Result<()> {
        self.on_replicas(key, &|store| store.unpin(key))
    }

    fn stats(&self) -> Stats {
        let view = self.inner.view();
        let groups: Vec<(usize, Vec<usize>)> = (0..view.members.len()).map(|m| (m, vec![0])).collect();
        let call = |store: &RemoteStore, _: &[usize]| vec![store.try_stats()];
        let mut shards = Vec::new();
        for stats in self.inner.fan_out(&view, &groups, &call).into_iter().flatten().flatten() {
            shards.extend(stats.shards);
        }
        let mut stats = Stats::from_shards(shards);
        stats.tickets_in_flight = self.inner.tickets_in_flight.load(Ordering::Acquire);
        stats
    }

    fn submit_batch_get(&self, keys: &[&[u8]], dsts: Vec<Vec<Region<'static>>>) -> Result<BatchTicket<Error>> {
        let store = ClusterStore { inner: Arc::clone(&self.inner), refresher: None };
        let limit = self.inner.options.client.max_tickets_in_flight;
        submit_batch_get(store, &self.inner.tickets_in_flight, limit, "kvtide-cluster-ticket", keys, dsts)
    }
}

impl CancellableRead for ClusterStore {
    /// Each member's part is read with the ticket's cancel flag; a member not reached yet when
    /// it is set reports its keys `Cancelled`.
    fn batch_get_cancellable(
        &self,
        keys: &[&[u8]],
        dsts: &[Vec<Region<'_>>],
        cancel: Option<&Arc<AtomicBool>>,
    ) -> Vec<Result<usize>> {
        if let Err(refused) = lists_per_key(keys.len(), dsts.len(), "destination") {
            return refused;
        }
        let call = |store: &RemoteStore, items: &[usize]| {
            let sub: Vec<Vec<Region<'_>>> = items.iter().map(|&i| dsts[i].clone()).collect();
            store.batch_get_cancellable(&key_list(keys, items), &sub, cancel)
        };
        self.inner.read(keys, &call, &is_not_found)
    }
}

impl ClusterStore {
    /// Runs `op` on each of `key`'s replicas: Ok when every reachable one succeeded (and at
    /// least one has the key), NotFound when none has it, else the first other error.
    fn on_replicas(&self, key: &[u8], op: &(dyn Fn(&RemoteStore) -> Result<()> + Sync)) -> Result<()> {
        let inner = &self.inner;
        let view = inner.view();
        let groups: Vec<(usize, Vec<usize>)> = inner.replicas(&view, key).into_iter().map(|m| (m, vec![0])).collect();
        if groups.is_empty() {
            return Err(no_member(&inner.options.name));
        }
        let call = |store: &RemoteStore, _: &[usize]| vec![op(store)];
        let mut outcome: Result<()> = Err(StoreError::NotFound.into());
        for answer in inner.fan_out(&view, &groups, &call).into_iter().flatten() {
            match answer {
                Ok(()) if is_not_found(&outcome) => outcome = Ok(()),
                Ok(()) => {}
                Err(e) if is_not_found::<()>(&Err(e.clone())) => {}
                Err(e) => {
                    if outcome.is_ok() || is_not_found(&outcome) {
                        outcome = Err(e);
                    }
                }
            }
        }
        outcome
    }
}
