//! Gathered writes from GPU memory go in parts: the next part's keys are reserved and planned
//! while the last part's copies run. Driven through a simulated device (host memory behind
//! `MemoryKind::Device`) whose copies complete only when the test's rule says so. Checks what
//! the H200 cannot show on its own: later parts are submitted before earlier ones complete,
//! keys whose copies landed are published while later parts still copy, every byte lands, a
//! failed copy or source check in one part fails only its own key, and every reservation and
//! counter is back at zero.

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::wait_idle;
use kvtide::transport::{Direction, EarlyStart, InFlight, Progress, Transfer, TransportError};
use kvtide::{Engine, Error, MemoryKind, PutOptions, Region, Store, StoreBuilder, Transport};

const GPU: MemoryKind = MemoryKind::Device { ordinal: 0 };
const MIB: usize = 1 << 20;
/// Page size of the simulated device pool.
const PAGE: usize = 64 << 10;
/// How long a held submission waits for the test before it completes anyway (and marks the run
/// as forced).
const HELD_BACKSTOP: Duration = Duration::from_secs(60);

/// A device whose memory is host memory; copies are made at submission but reported complete
/// only once `parts_before_completion` submissions were seen (or after a backstop that marks
/// the run as forced).
struct SimDevice {
    submissions: Mutex<Vec<usize>>,
    parts_before_completion: usize,
    forced: AtomicBool,
    /// Pages (device addresses) whose copy fails.
    failing: Mutex<HashSet<u64>>,
    /// Pages whose check fails.
    refused: Mutex<HashSet<u64>>,
    completed: AtomicUsize,
    /// Submissions from this one on complete only once `released` is set.
    held_from: usize,
    released: AtomicBool,
}

impl SimDevice {
    fn new(parts_before_completion: usize) -> Arc<SimDevice> {
        SimDevice::holding(parts_before_completion, usize::MAX)
    }

    fn holding(parts_before_completion: usize, held_from: usize) -> Arc<SimDevice> {
        Arc::new(SimDevice {
            submissions: Mutex::new(Vec::new()),
            parts_before_completion,
            forced: AtomicBool::new(false),
            failing: Mutex::new(HashSet::new()),
            refused: Mutex::new(HashSet::new()),
            completed: AtomicUsize::new(0),
            held_from,
            released: AtomicBool::new(false),
        })
    }
}

struct Transport0(Arc<SimDevice>);

struct SimInFlight {
    device: Arc<SimDevice>,
    /// Which submission this is (from 0).
    part: usize,
    results: Vec<Result<(), TransportError>>,
    started: Instant,
    done: bool,
}

impl Progress for SimInFlight {
    fn poll(&mut self) -> bool {
        if self.done {
            return true;
        }
        let seen = self.device.submissions.lock().expect("lock").len();
        let held = self.part >= self.device.held_from && !self.device.released.load(Ordering::SeqCst);
        if seen >= self.device.parts_before_completion && !held {
            self.done = true;
        } else if self.started.elapsed() > if held { HELD_BACKSTOP } else { Duration::from_secs(5) } {
            self.device.forced.store(true, Ordering::SeqCst);
            self.done = true;
        }
        if self.done {
            self.device.completed.fetch_add(1, Ordering::SeqCst);
        }
        self.done
    }
    fn take_results(&mut self) -> Vec<Result<(), TransportError>> {
        std::mem::take(&mut self.results)
    }
}

impl Transport for Transport0 {
    fn name(&self) -> &'static str {
        "sim-device"
    }
    fn completes_inline(&self) -> bool {
        false
    }
    fn check(&self, lists: &[&[Region<'_>]], _writable: bool) -> Vec<Option<TransportError>> {
        let refused = self.0.refused.lock().expect("lock");
        lists
            .iter()
            .map(|regions| {
                regions.iter().find(|r| refused.contains(&r.addr())).map(|r| TransportError::DevicePointer {
                    addr: r.addr(),
                    len: r.len() as u64,
                    why: "refused by the test".into(),
                })
            })
            .collect()
    }
    unsafe fn submit(
        &self,
        direction: Direction,
        transfers: &[Transfer],
        _early: Option<EarlyStart>,
    ) -> Result<InFlight, TransportError> {
        assert_eq!(direction, Direction::DeviceToHost);
        let failing = self.0.failing.lock().expect("lock").clone();
        let results = transfers
            .iter()
            .map(|t| {
                if t.pieces.iter().any(|p| failing.contains(&p.addr)) {
                    return Err(TransportError::Io("injected copy failure".into()));
                }
                for p in &t.pieces {
                    // SAFETY: the "device" pages are the test's live host buffer; the host side is
                    // the engine's reservation, exclusive until this submission completed.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            p.addr as *const u8,
                            (t.host + p.host_offset) as *mut u8,
                            p.len as usize,
                        )
                    };
                }
                Ok(())
            })
            .collect();
        let part = {
            let mut submissions = self.0.submissions.lock().expect("lock");
            submissions.push(transfers.len());
            submissions.len() - 1
        };
        Ok(InFlight::new(Box::new(SimInFlight {
            device: Arc::clone(&self.0),
            part,
            results,
            started: Instant::now(),
            done: false,
        })))
    }
}

fn store() -> Engine {
    StoreBuilder::new().dram_bytes(256 << 20).shards(2).pin_threads(false).idle_spin_us(20).open().expect("open")
}

/// `objects` objects of `object_bytes` each, cut into pages laid out in reverse over one pool.
struct Pool {
    memory: Vec<u8>,
    keys: Vec<Vec<u8>>,
    object_bytes: usize,
}

impl Pool {
    fn new(objects: usize, object_bytes: usize) -> Pool {
        let keys: Vec<Vec<u8>> = (0..objects).map(|i| format!("parts/{i}").into_bytes()).collect();
        let mut memory = vec![0u8; objects * object_bytes];
        let pages = object_bytes / PAGE;
        for (o, key) in keys.iter().enumerate() {
            let value = value_of(key, object_bytes);
            for p in 0..pages {
                let at = self_page(objects * pages, o * pages + p) * PAGE;
                memory[at..at + PAGE].copy_from_slice(&value[p * PAGE..(p + 1) * PAGE]);
            }
        }
        Pool { memory, keys, object_bytes }
    }

    fn page_addr(&self, object: usize, page: usize) -> u64 {
        let pages = self.object_bytes / PAGE;
        self.memory.as_ptr() as u64 + (self_page(self.keys.len() * pages, object * pages + page) * PAGE) as u64
    }

    fn sources(&self) -> Vec<Vec<Region<'_>>> {
        let pages = self.object_bytes / PAGE;
        (0..self.keys.len())
            .map(|o| {
                (0..pages)
                    // SAFETY: pages of the pool, which outlives the write.
                    .map(|p| unsafe { Region::from_raw(self.page_addr(o, p), PAGE, GPU) })
                    .collect()
            })
            .collect()
    }

    fn key_refs(&self) -> Vec<&[u8]> {
        self.keys.iter().map(Vec::as_slice).collect()
    }
}

/// A value distinct per key and per 8-byte word (cheap to make in a debug build).
fn value_of(key: &[u8], len: usize) -> Vec<u8> {
    let seed = key.iter().fold(0u64, |h, &b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
    (0..len / 8).flat_map(|w| (seed << 32 ^ w as u64).to_le_bytes()).collect()
}

/// Page `i` of `n` sits at slot `n - 1 - i`: no object's pages are contiguous with its key order.
fn self_page(n: usize, i: usize) -> usize {
    n - 1 - i
}

#[test]
fn later_parts_go_out_before_earlier_ones_complete_and_every_byte_lands() {
    let s = store();
    let pool = Pool::new(48, MIB);
    let sources = pool.sources();
    // 48 MiB: parts of 4, 4, 6, 6, ... MiB (at least 4 MiB, at most an eighth).
    let device = SimDevice::new(5);
    let results =
        s.batch_put_from_via(&pool.key_refs(), &sources, PutOptions::INSERT, Arc::new(Transport0(Arc::clone(&device))));
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let parts = device.submissions.lock().expect("lock").clone();
    assert!(parts.len() >= 5, "a 48 MiB write goes in parts: {parts:?}");
    assert_eq!(parts.iter().sum::<usize>(), 48, "every key in exactly one part");
    assert!(!device.forced.load(Ordering::SeqCst), "no part waited for an earlier one to complete before it went out");
    for key in &pool.keys {
        assert_eq!(s.get(key).expect("get"), value_of(key, pool.object_bytes), "{}", String::from_utf8_lossy(key));
    }
    let stats = s.stats();
    assert_eq!(stats.gpu.write_phase_us.len(), 5);
    wait_idle(&s);
    assert_eq!(s.stats().total.writes_in_flight, 0);
}

#[test]
fn a_failed_copy_or_check_in_one_part_fails_only_its_key() {
    let s = store();
    let pool = Pool::new(48, MIB);
    let sources = pool.sources();
    let device = SimDevice::new(1);
    // Key 30 (a later part) fails its copy on one page, key 40 fails its source check.
    device.failing.lock().expect("lock").insert(pool.page_addr(30, 7));
    device.refused.lock().expect("lock").insert(pool.page_addr(40, 0));
    let used_before = s.stats().total.bytes_used;
    let results =
        s.batch_put_from_via(&pool.key_refs(), &sources, PutOptions::INSERT, Arc::new(Transport0(Arc::clone(&device))));
    for (i, r) in results.iter().enumerate() {
        match i {
            30 => assert!(matches!(r, Err(Error::Io(_))), "{r:?}"),
            40 => assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}"),
            _ => assert!(r.is_ok(), "key {i}: {r:?}"),
        }
    }
    assert!(device.submissions.lock().expect("lock").len() > 1);
    assert_eq!(s.get(&pool.keys[30]), Err(Error::NotFound), "a partly written key is never published");
    assert_eq!(s.get(&pool.keys[40]), Err(Error::NotFound));
    assert_eq!(s.get(&pool.keys[31]).expect("neighbour"), value_of(&pool.keys[31], pool.object_bytes));
    wait_idle(&s);
    let total = s.stats().total;
    assert_eq!(total.writes_in_flight, 0);
    assert_eq!(total.objects, 46);
    // The two failed reservations were given back: only the 46 published objects hold memory.
    assert_eq!(total.bytes_used - used_before, 46 * pool.object_bytes as u64);
    // Written again with nothing failing, the two keys go in.
    device.failing.lock().expect("lock").clear();
    device.refused.lock().expect("lock").clear();
    let results = s.batch_put_from_via(&pool.key_refs(), &sources, PutOptions::UPSERT, Arc::new(Transport0(device)));
    assert!(results.iter().all(Result::is_ok));
    assert_eq!(s.get(&pool.keys[30]).expect("get"), value_of(&pool.keys[30], pool.object_bytes));
    wait_idle(&s);
}

#[test]
fn keys_whose_copies_landed_are_published_while_later_parts_still_copy() {
    let s = store();
    let pool = Pool::new(48, MIB);
    let sources = pool.sources();
    // The first two parts complete at once; the rest wait for the test.
    let device = SimDevice::holding(1, 2);
    let keys = pool.key_refs();
    let (first, last) = (&pool.keys[0], &pool.keys[47]);
    let results = std::thread::scope(|scope| {
        let writer = scope.spawn(|| {
            s.batch_put_from_via(&keys, &sources, PutOptions::INSERT, Arc::new(Transport0(Arc::clone(&device))))
        });
        // Well inside the held parts' backstop, however slow the machine.
        let deadline = Instant::now() + HELD_BACKSTOP / 2;
        while s.get(first).is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let early = s.get(first);
        let held = s.get(last);
        device.released.store(true, Ordering::SeqCst);
        let results = writer.join().expect("writer");
        assert_eq!(early.expect("a key of the first part, published before the write returned"), value_of(first, MIB));
        assert_eq!(held, Err(Error::NotFound), "a key whose copy is still running is not published");
        results
    });
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert!(!device.forced.load(Ordering::SeqCst), "the held parts completed when released");
    assert!(device.submissions.lock().expect("lock").len() > 2);
    for key in &pool.keys {
        assert_eq!(s.get(key).expect("get"), value_of(key, pool.object_bytes), "{}", String::from_utf8_lossy(key));
    }
    wait_idle(&s);
    let total = s.stats().total;
    assert_eq!(total.writes_in_flight, 0);
    assert_eq!(total.objects, 48);
}

#[test]
fn a_small_gpu_write_is_one_part() {
    let s = store();
    let pool = Pool::new(3, 2 * MIB);
    let sources = pool.sources();
    let device = SimDevice::new(1);
    let results =
        s.batch_put_from_via(&pool.key_refs(), &sources, PutOptions::INSERT, Arc::new(Transport0(Arc::clone(&device))));
    assert!(results.iter().all(Result::is_ok));
    assert_eq!(*device.submissions.lock().expect("lock"), vec![3]);
    wait_idle(&s);
}
