//! Fuzzes the chunk handles' state machine through the real engine: a progressive put whose
//! chunks are written, sealed or aborted in any order while readers follow it, wait on chunks,
//! poll and drop their handles. Checked: a chunk that is ready holds the producer's bytes; each
//! chunk is handed out by `poll` once; every handle settles once the producer is done (Ok with
//! the object's bytes when every chunk was written, ProducerAborted when one never was);
//! nothing stays held.
#![no_main]

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use kvtide::{ChunkHandle, Engine, Error, HandleStatus, MemoryKind, PutOptions, Region, Store, StoreBuilder};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Op {
    PutChunk(u8),
    Seal,
    Abort,
    Follow { chunk_bytes: u8 },
    DropReader(u8),
    WaitChunk { reader: u8, chunk: u8 },
    Poll(u8),
    Status(u8),
}

#[derive(Arbitrary, Debug)]
struct Input {
    total: u16,
    chunk: u8,
    ops: Vec<Op>,
}

static STORE: OnceLock<Engine> = OnceLock::new();
static NEXT_KEY: AtomicU64 = AtomicU64::new(0);

struct Reader {
    handle: Option<ChunkHandle>,
    buf: Vec<u8>,
    polled: HashSet<usize>,
}

fn reader_region(buf: &mut [u8]) -> Region<'static> {
    // SAFETY: the buffer outlives every transfer into it: it is dropped only after the store has
    // no handle running (checked at the end of each input).
    unsafe { Region::from_raw(buf.as_mut_ptr() as u64, buf.len(), MemoryKind::Host) }
}

fuzz_target!(|input: Input| {
    let store = STORE.get_or_init(|| {
        StoreBuilder::new().dram_bytes(64 << 20).shards(2).pin_threads(false).open().expect("open store")
    });
    let total = u64::from(input.total % 8192);
    let chunk = u64::from(input.chunk).max(1) * 16;
    let n = total.div_ceil(chunk).max(1) as usize;
    let key = format!("fuzz/{}", NEXT_KEY.fetch_add(1, Ordering::Relaxed)).into_bytes();
    let value: Vec<u8> = (0..total).map(|i| (i.wrapping_mul(31) + 7) as u8).collect();
    let mut put = Some(store.progressive_put(&key, total, chunk, PutOptions::INSERT).expect("progressive put"));
    let mut written = vec![false; n];
    let (mut sealed, mut aborted) = (false, false);
    let mut readers: Vec<Reader> = Vec::new();
    for op in input.ops.iter().take(64) {
        match op {
            Op::PutChunk(i) => {
                let Some(p) = &put else { continue };
                let i = usize::from(*i) % n;
                let r = p.chunk_range(i).expect("chunk range");
                let result = p.put_chunk(i, Region::host_readonly(&value[r.start as usize..r.end as usize]));
                if written[i] {
                    assert_eq!(result, Err(Error::AlreadyExists));
                } else {
                    assert_eq!(result, Ok(()));
                    written[i] = true;
                }
            }
            Op::Seal => {
                let Some(p) = &mut put else { continue };
                let result = p.seal();
                if written.iter().all(|&w| w) {
                    assert_eq!(result, Ok(()));
                    sealed = true;
                    put = None;
                } else {
                    assert!(matches!(result, Err(Error::InvalidArgument(_))), "{result:?}");
                }
            }
            Op::Abort => {
                if let Some(p) = put.take() {
                    p.abort();
                    aborted = true;
                }
            }
            Op::Follow { chunk_bytes } => {
                if readers.len() >= 4 {
                    continue;
                }
                let mut buf = vec![0u8; total as usize];
                let region = reader_region(&mut buf);
                match store.progressive_get_unsealed(&key, region, u64::from(*chunk_bytes).max(1) * 8) {
                    Ok(handle) => {
                        assert!(!aborted, "a reader of an aborted put");
                        readers.push(Reader { handle: Some(handle), buf, polled: HashSet::new() });
                    }
                    Err(e) => assert!(aborted && e == Error::NotFound, "{e:?}"),
                }
            }
            Op::DropReader(i) => {
                if let Some(r) = readers.get_mut(usize::from(*i) % 4) {
                    r.handle = None;
                }
            }
            Op::WaitChunk { reader, chunk: c } => {
                let Some(r) = readers.get(usize::from(*reader) % 4) else { continue };
                let Some(h) = &r.handle else { continue };
                let c = usize::from(*c) % h.num_chunks();
                if h.wait_chunk_timeout(c, 0) == Ok(true) {
                    let range = h.chunk_range(c).expect("range");
                    let (s, e) = (range.start as usize, range.end as usize);
                    // SAFETY: chunk c settled, so nothing writes its range any more; other
                    // ranges of the buffer may still be written, so no reference to the whole
                    // buffer is made while the handle runs.
                    let got = unsafe { std::slice::from_raw_parts(r.buf.as_ptr().add(s), e - s) };
                    assert_eq!(got, &value[s..e], "a ready chunk holds the producer's bytes");
                }
            }
            Op::Poll(i) => {
                let Some(r) = readers.get_mut(usize::from(*i) % 4) else { continue };
                let Some(h) = &r.handle else { continue };
                for c in h.poll() {
                    assert!(c < h.num_chunks() && r.polled.insert(c), "chunk {c} polled twice");
                }
            }
            Op::Status(i) => {
                let Some(r) = readers.get(usize::from(*i) % 4) else { continue };
                let Some(h) = &r.handle else { continue };
                match h.status() {
                    HandleStatus::Pending { done, failed, total } => assert!(done + failed < total),
                    HandleStatus::Done | HandleStatus::Failed { .. } => {}
                }
            }
        }
    }
    // The producer finishes: seal if it can, else it is dropped (an abort).
    if let Some(mut p) = put.take() {
        if written.iter().all(|&w| w) && p.seal().is_ok() {
            sealed = true;
        }
    }
    for r in &readers {
        let Some(h) = &r.handle else { continue };
        let all = h.wait_all();
        // Every chunk the producer wrote reaches its readers, sealed or not; a reader with a
        // chunk that never landed fails with ProducerAborted.
        if sealed || written.iter().all(|&w| w) {
            assert_eq!(all, Ok(()));
            assert_eq!(r.buf, value, "a reader of every chunk holds the object");
        } else {
            assert!(matches!(all, Err(Error::ProducerAborted(_))), "{all:?}");
        }
    }
    if sealed {
        assert_eq!(store.get(&key).expect("sealed object"), value);
        store.remove(&key, true).expect("remove");
    }
    drop(readers.iter_mut().map(|r| r.handle.take()).collect::<Vec<_>>());
    // Dropped handles' drivers finish in the background: the buffers live until they have.
    let started = Instant::now();
    loop {
        store.sync_shards().expect("sync");
        let held = store.stats().held_resources();
        if held.is_zero() {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "still held: {held:?}");
        std::thread::yield_now();
    }
    drop(readers);
});
