//! The write-through churn workload the durability tests share (embedded and through the owner):
//! `hot/object`, 200 `once/*` objects, then upserts over 8 keys of 256 KiB.

pub const ONCE: u64 = 200;
pub const ONCE_BYTES: usize = 64 << 10;
pub const HOT_BYTES: usize = 64 << 10;
pub const CHURN_KEYS: u64 = 8;
pub const CHURN_BYTES: usize = 256 << 10;
pub const CHURN_PUTS: u64 = 2000;

pub fn once_key(i: u64) -> Vec<u8> {
    format!("once/{i}").into_bytes()
}
