//! A client of a running `kvtide-owner`: the same `Store` calls as the embedded quickstart,
//! against a shared owner.
//!
//! ```sh
//! cargo run --release --bin kvtide-owner &                       # terminal 1
//! cargo run --release --example remote_client                    # Unix socket + shared memory
//! KVTIDE_TOKEN_FILE=~/.local/share/kvtide/token \
//!   cargo run --release --example remote_client -- 127.0.0.1:7370  # TCP with the owner's token
//! ```

use kvtide::{PutOptions, Region, Store};
use kvtide_remote::RemoteStore;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let address = std::env::args().nth(1).unwrap_or_else(|| {
        let home = std::env::var("HOME").unwrap_or_default();
        format!("unix:{home}/.local/share/kvtide/owner.sock")
    });
    let store = RemoteStore::connect(&address)?;
    println!("connected to {address} (shared memory: {})", store.uses_shared_memory());
    let blocks: Vec<Vec<u8>> = (0..64u32).map(|i| vec![i as u8; 256 << 10]).collect();
    for (i, block) in blocks.iter().enumerate() {
        store.put(format!("example/block{i}").as_bytes(), block, PutOptions::UPSERT)?;
    }
    let keys: Vec<Vec<u8>> = (0..64).map(|i| format!("example/block{i}").into_bytes()).collect();
    let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    println!("prefix hits: {}", store.prefix_hits(&key_refs)?);
    let mut pages = vec![0u8; 64 * (256 << 10)];
    let dsts: Vec<Vec<Region<'_>>> = pages.chunks_mut(256 << 10).map(|p| vec![Region::host(p)]).collect();
    let results = store.batch_get_into_multi_buffers(&key_refs, &dsts);
    drop(dsts);
    let ok = results.iter().filter(|r| r.is_ok()).count();
    let intact = pages.chunks(256 << 10).zip(&blocks).all(|(got, want)| got == want.as_slice());
    println!("read back {ok}/64 blocks, bytes intact: {intact}");
    let stats = store.stats();
    println!("owner: {} objects, {} bytes used", stats.total.objects, stats.total.bytes_used);
    Ok(())
}
