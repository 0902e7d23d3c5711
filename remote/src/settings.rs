//! `OwnerSettings`: what a `kvtide-owner` user fills in (flags, a TOML file, `KVTIDE_*`
//! variables), and the derivation of a usable default for everything left out: a data directory,
//! a DRAM pool sized from available memory (capped), an SSD tier in the data directory, a Unix
//! socket there, TCP on 127.0.0.1 with a generated token.
//!
//! Precedence: flags > TOML file > `KVTIDE_*` variables (store fields) > derived defaults.
//! It never starts anything; `resolve` only decides and creates the data directory and token.

use std::net::SocketAddr;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::auth::Token;
use crate::server::OwnerConfig;
use kvtide::{parse_bytes, StoreBuilder};

/// Default TCP address: loopback only.
pub const DEFAULT_TCP: &str = "127.0.0.1:7370";
/// The derived DRAM pool: a quarter of available memory, within these bounds.
const DRAM_MIN_BYTES: u64 = 256 << 20;
const DRAM_MAX_BYTES: u64 = 16 << 30;
/// The derived SSD tier: an eighth of the free disk space, within these bounds.
const SSD_MIN_BYTES: u64 = 1 << 30;
const SSD_MAX_BYTES: u64 = 64 << 30;

/// Owner settings; every field is optional and has a derived default.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct OwnerSettings {
    /// Data directory (SSD tier, socket, token). Default `$KVTIDE_DATA_DIR`, else
    /// `$XDG_DATA_HOME/kvtide`, else `~/.local/share/kvtide`.
    pub data_dir: Option<PathBuf>,
    /// Unix socket path, or "off". Default `<data_dir>/owner.sock`.
    pub unix_socket: Option<String>,
    /// TCP address, or "off". Default 127.0.0.1:7370.
    pub tcp: Option<String>,
    /// Token file for TCP clients. Default `<data_dir>/token`, created (0600) when missing.
    pub token_file: Option<PathBuf>,
    /// Require the token on TCP (default true; false is only accepted on loopback).
    pub tcp_auth: Option<bool>,
    /// Map the DRAM arena into Unix clients (default true). Every such client can then read every
    /// object in DRAM; turn it off where clients do not trust each other. (`shared_memory` is
    /// the older name.)
    #[serde(alias = "shared_memory")]
    pub share_arena: Option<bool>,
    /// SSD tier in `<data_dir>/ssd` (default true).
    pub ssd: Option<bool>,
    /// DRAM pool. Default: a quarter of available memory, 256 MiB..16 GiB.
    #[serde(deserialize_with = "de_size")]
    pub dram_bytes: Option<u64>,
    /// SSD tier size. Default: an eighth of the free space, 1..64 GiB.
    #[serde(deserialize_with = "de_size")]
    pub ssd_bytes: Option<u64>,
    /// Shards. Default: one per allowed CPU.
    pub shards: Option<usize>,
    /// Connections served at once (default 256).
    pub max_connections: Option<usize>,
    /// TCP connections still in their handshake (default 32); they never take the slots above.
    pub max_unauthenticated_connections: Option<usize>,
    pub max_leases_per_connection: Option<u32>,
    #[serde(deserialize_with = "de_size")]
    pub max_frame_bytes: Option<u64>,
    #[serde(deserialize_with = "de_size")]
    pub chunk_bytes: Option<u64>,
    /// Request bytes buffered by all connections together (default 256 MiB).
    #[serde(deserialize_with = "de_size")]
    pub max_buffered_bytes: Option<u64>,
    /// Each connection's guaranteed share of them (default max_buffered_bytes / (2 * max_connections)).
    #[serde(deserialize_with = "de_size")]
    pub connection_buffered_bytes: Option<u64>,
    pub io_timeout_ms: Option<u64>,
    /// Whole handshake, from the accept (default 5 s).
    pub handshake_timeout_ms: Option<u64>,
    /// Each frame, from its first byte (default 10 s).
    pub payload_timeout_ms: Option<u64>,
    /// A connection without a request for this long is closed (default 10 min).
    pub idle_timeout_ms: Option<u64>,
    pub lease_ttl_ms: Option<u32>,
    /// Any other `StoreBuilder` field (same names as its TOML).
    pub store: Option<toml::Table>,
}

fn de_size<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Number(u64),
        Text(String),
    }
    match Size::deserialize(d)? {
        Size::Number(n) => Ok(Some(n)),
        Size::Text(s) => parse_bytes(&s).map(Some).ok_or_else(|| serde::de::Error::custom(format!("bad size {s:?}"))),
    }
}

/// What `resolve` decided.
#[derive(Debug)]
pub struct ResolvedOwner {
    pub store: StoreBuilder,
    pub owner: OwnerConfig,
    pub data_dir: PathBuf,
    /// Token file in use (TCP with auth), and whether it was just created.
    pub token_file: Option<(PathBuf, bool)>,
}

/// Usage text of `kvtide-owner`.
pub const USAGE: &str = "\
kvtide-owner: serve a kvtide store to other processes (Unix socket + shared memory) and hosts (TCP)

USAGE: kvtide-owner [OPTIONS]

  --config FILE            TOML settings (same names as below, plus a [store] table)
  --data-dir DIR           data directory (SSD tier, socket, token)
  --unix PATH|off          Unix socket (default <data-dir>/owner.sock)
  --tcp ADDR|off           TCP address (default 127.0.0.1:7370)
  --token-file FILE        token TCP clients must know (default <data-dir>/token, created)
  --no-auth                TCP without a token (loopback addresses only)
  --no-shared-arena        do not map the arena into Unix clients (they get socket copies;
                           otherwise every Unix client can read every object in DRAM)
  --no-ssd                 DRAM only
  --dram-bytes SIZE        DRAM pool (default: 1/4 of available memory, 256MiB..16GiB)
  --ssd-bytes SIZE         SSD tier (default: 1/8 of free disk, 1GiB..64GiB)
  --shards N               shards (default: one per CPU)
  --max-connections N      connections served at once (default 256)
  -h, --help               this text

KVTIDE_* variables set store fields (KVTIDE_DRAM_BYTES=8GiB ...); KVTIDE_LOG sets the log filter.
";

impl OwnerSettings {
    /// Reads a TOML file.
    pub fn from_toml_file(path: &Path) -> Result<OwnerSettings, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Parses command-line flags (without the program name) into settings and the config file
    /// to read underneath them. `Ok(None)` means help was asked for.
    pub fn from_args(
        args: impl IntoIterator<Item = String>,
    ) -> Result<Option<(OwnerSettings, Option<PathBuf>)>, String> {
        let mut s = OwnerSettings::default();
        let mut config = None;
        let mut args = args.into_iter();
        while let Some(arg) = args.next() {
            let (flag, inline) = match arg.split_once('=') {
                Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
                _ => (arg.clone(), None),
            };
            let mut value = |name: &str| -> Result<String, String> {
                inline.clone().or_else(|| args.next()).ok_or_else(|| format!("{name} needs a value"))
            };
            let size = |name: &str, v: String| parse_bytes(&v).ok_or_else(|| format!("{name} {v:?}: not a size"));
            match flag.as_str() {
                "-h" | "--help" => return Ok(None),
                "--config" => config = Some(PathBuf::from(value(&flag)?)),
                "--data-dir" => s.data_dir = Some(PathBuf::from(value(&flag)?)),
                "--unix" => s.unix_socket = Some(value(&flag)?),
                "--tcp" => s.tcp = Some(value(&flag)?),
                "--token-file" => s.token_file = Some(PathBuf::from(value(&flag)?)),
                "--no-auth" => s.tcp_auth = Some(false),
                "--no-shared-arena" | "--no-shm" => s.share_arena = Some(false),
                "--no-ssd" => s.ssd = Some(false),
                "--dram-bytes" => s.dram_bytes = Some(size(&flag, value(&flag)?)?),
                "--ssd-bytes" => s.ssd_bytes = Some(size(&flag, value(&flag)?)?),
                "--shards" => s.shards = Some(value(&flag)?.parse().map_err(|_| "--shards needs a count".to_string())?),
                "--max-connections" => {
                    s.max_connections =
                        Some(value(&flag)?.parse().map_err(|_| "--max-connections needs a count".to_string())?)
                }
                other => return Err(format!("unknown option {other:?} (try --help)")),
            }
        }
        Ok(Some((s, config)))
    }

    /// `self` with every field that `over` sets replaced by `over`'s.
    pub fn overlay(self, over: OwnerSettings) -> OwnerSettings {
        macro_rules! pick {
            ($($f:ident),*) => { OwnerSettings { $($f: over.$f.or(self.$f)),* } };
        }
        pick!(
            data_dir,
            unix_socket,
            tcp,
            token_file,
            tcp_auth,
            share_arena,
            ssd,
            dram_bytes,
            ssd_bytes,
            shards,
            max_connections,
            max_unauthenticated_connections,
            max_leases_per_connection,
            max_frame_bytes,
            chunk_bytes,
            max_buffered_bytes,
            connection_buffered_bytes,
            io_timeout_ms,
            handshake_timeout_ms,
            payload_timeout_ms,
            idle_timeout_ms,
            lease_ttl_ms,
            store
        )
    }

    /// Derives everything left out, creates the data directory (0700) and, for TCP with
    /// authentication, the token file when missing. `vars` are the environment variables.
    pub fn resolve(&self, vars: &[(String, String)]) -> Result<ResolvedOwner, String> {
        let env = |name: &str| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        let data_dir = match (&self.data_dir, env("KVTIDE_DATA_DIR")) {
            (Some(d), _) => d.clone(),
            (None, Some(d)) => PathBuf::from(d),
            (None, None) => default_data_dir(&env),
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&data_dir)
            .map_err(|e| format!("cannot create data directory {}: {e}", data_dir.display()))?;

        let table = self.store.clone().unwrap_or_default();
        let store_sets =
            |field: &str| table.contains_key(field) || env(&format!("KVTIDE_{}", field.to_uppercase())).is_some();
        let mut store: StoreBuilder =
            toml::Value::Table(table.clone()).try_into().map_err(|e| format!("[store]: {e}"))?;
        store = store.with_vars(vars.iter().cloned()).map_err(|e| e.to_string())?;
        if let Some(n) = self.shards {
            store.shards = Some(n);
        }
        if let Some(b) = self.dram_bytes {
            store.dram_bytes = b;
        } else if !store_sets("dram_bytes") {
            store.dram_bytes = derived_dram_bytes();
        }
        if self.ssd != Some(false) && store.ssd_dir.is_none() {
            let ssd_dir = data_dir.join("ssd");
            let bytes = match self.ssd_bytes {
                Some(b) => Some(b),
                None if store_sets("ssd_bytes") => Some(store.ssd_bytes),
                None => derived_ssd_bytes(&data_dir),
            };
            if let Some(bytes) = bytes {
                store.ssd_bytes = bytes;
                store.ssd_dir = Some(ssd_dir);
            } else {
                tracing::warn!(dir = %data_dir.display(), "too little free disk space for an SSD tier; DRAM only");
            }
        } else if let Some(b) = self.ssd_bytes {
            store.ssd_bytes = b;
        }

        let off = |v: &Option<String>| v.as_deref().is_some_and(|v| v.eq_ignore_ascii_case("off"));
        let unix_socket = if off(&self.unix_socket) {
            None
        } else {
            Some(self.unix_socket.as_ref().map_or_else(|| data_dir.join("owner.sock"), PathBuf::from))
        };
        let tcp = if off(&self.tcp) {
            None
        } else {
            let text = self.tcp.as_deref().unwrap_or(DEFAULT_TCP);
            Some(text.parse::<SocketAddr>().map_err(|e| format!("tcp {text:?}: {e}"))?)
        };
        let mut owner = OwnerConfig { unix_socket, tcp, ..OwnerConfig::default() };
        let mut token_file = None;
        if tcp.is_some() {
            if self.tcp_auth == Some(false) {
                owner.allow_unauthenticated_loopback = true;
            } else {
                let path = self.token_file.clone().unwrap_or_else(|| data_dir.join("token"));
                let (token, created) = Token::load_or_create(&path)?;
                owner.tcp_token = Some(token);
                token_file = Some((path, created));
            }
        }
        if let Some(v) = self.share_arena {
            owner.share_arena = v;
        }
        if let Some(v) = self.max_connections {
            owner.max_connections = v;
        }
        if let Some(v) = self.max_unauthenticated_connections {
            owner.max_unauthenticated_connections = v;
        }
        if let Some(v) = self.max_leases_per_connection {
            owner.max_leases_per_connection = v;
        }
        let u32_size = |v: u64, name: &str| u32::try_from(v).map_err(|_| format!("{name} = {v} is too large"));
        if let Some(v) = self.max_frame_bytes {
            owner.max_payload_bytes = u32_size(v, "max_frame_bytes")?;
        }
        if let Some(v) = self.chunk_bytes {
            owner.chunk_bytes = u32_size(v, "chunk_bytes")?;
        }
        if let Some(v) = self.max_buffered_bytes {
            owner.max_buffered_bytes = v;
        }
        owner.connection_buffered_bytes = self.connection_buffered_bytes;
        if let Some(v) = self.io_timeout_ms {
            owner.io_timeout_ms = v;
        }
        if let Some(v) = self.handshake_timeout_ms {
            owner.handshake_timeout_ms = v;
        }
        if let Some(v) = self.payload_timeout_ms {
            owner.payload_timeout_ms = v;
        }
        if let Some(v) = self.idle_timeout_ms {
            owner.idle_timeout_ms = v;
        }
        if let Some(v) = self.lease_ttl_ms {
            owner.lease_ttl_ms = v;
        }
        Ok(ResolvedOwner { store, owner, data_dir, token_file })
    }
}

fn default_data_dir(env: &dyn Fn(&str) -> Option<String>) -> PathBuf {
    if let Some(xdg) = env("XDG_DATA_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(xdg).join("kvtide");
    }
    if let Some(home) = env("HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(home).join(".local/share/kvtide");
    }
    // SAFETY: getuid has no inputs and cannot fail.
    let uid = unsafe { libc::getuid() };
    std::env::temp_dir().join(format!("kvtide-{uid}"))
}

/// A quarter of `MemAvailable`, within bounds (the minimum when it cannot be read).
fn derived_dram_bytes() -> u64 {
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|text| {
        text.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kib| kib * 1024)
    });
    available.map_or(DRAM_MIN_BYTES, |a| (a / 4).clamp(DRAM_MIN_BYTES, DRAM_MAX_BYTES))
}

/// An eighth of the free space under `dir`, within bounds; None when that is below the minimum.
fn derived_ssd_bytes(dir: &Path) -> Option<u64> {
    let path = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statvfs is plain data; the call fills it for a valid NUL-terminated path.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    let free = (st.f_bavail as u64).saturating_mul(st.f_frsize as u64);
    let want = free / 8;
    (want >= SSD_MIN_BYTES).then(|| want.min(SSD_MAX_BYTES))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kvtide-settings-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn defaults_are_usable_and_secure() {
        let dir = temp_dir("defaults");
        let s = OwnerSettings { data_dir: Some(dir.clone()), ..OwnerSettings::default() };
        let r = s.resolve(&[]).expect("resolve");
        assert_eq!(r.owner.unix_socket, Some(dir.join("owner.sock")));
        assert_eq!(r.owner.tcp, Some(DEFAULT_TCP.parse().expect("addr")));
        assert!(r.owner.tcp_token.is_some(), "TCP requires a token by default");
        assert!(r.token_file.as_ref().is_some_and(|(_, created)| *created));
        assert!((DRAM_MIN_BYTES..=DRAM_MAX_BYTES).contains(&r.store.dram_bytes));
        let o = &r.owner;
        assert_eq!((o.max_connections, o.max_unauthenticated_connections), (256, 32));
        assert_eq!((o.max_buffered_bytes, o.connection_share_bytes()), (256 << 20, 512 << 10));
        assert_eq!((o.handshake_timeout_ms, o.payload_timeout_ms, o.idle_timeout_ms), (5_000, 10_000, 600_000));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join("token")).expect("token").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // The second start reads the same token.
        let r2 = s.resolve(&[]).expect("resolve again");
        assert_eq!(r2.owner.tcp_token, r.owner.tcp_token);
        assert!(r2.token_file.is_some_and(|(_, created)| !created));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn flags_override_file_override_env() {
        let dir = temp_dir("override");
        let file: OwnerSettings = toml::from_str(&format!(
            "data_dir = {:?}\ndram_bytes = \"64MiB\"\ntcp = \"off\"\nssd = false\n[store]\nmax_key_bytes = 200\n",
            dir.display().to_string()
        ))
        .expect("toml");
        let (flags, config) = OwnerSettings::from_args(
            ["--dram-bytes", "32MiB", "--shards=2", "--unix", "off", "--tcp", "127.0.0.1:0", "--no-auth"]
                .map(String::from),
        )
        .expect("args")
        .expect("not help");
        assert!(config.is_none());
        let s = file.overlay(flags);
        let vars = vec![("KVTIDE_DRAM_BYTES".to_string(), "1GiB".to_string())];
        let r = s.resolve(&vars).expect("resolve");
        assert_eq!(r.store.dram_bytes, 32 << 20);
        assert_eq!(r.store.shards, Some(2));
        assert_eq!(r.store.max_key_bytes, 200);
        assert!(r.store.ssd_dir.is_none());
        assert!(r.owner.unix_socket.is_none());
        assert!(r.owner.allow_unauthenticated_loopback && r.owner.tcp_token.is_none());
        assert!(r.owner.share_arena, "shared by default");
        let limits: OwnerSettings = toml::from_str(
            "max_unauthenticated_connections = 4\nconnection_buffered_bytes = \"256KiB\"\nhandshake_timeout_ms = 300\n\
             payload_timeout_ms = 400\nidle_timeout_ms = 500\n",
        )
        .expect("toml");
        let o = s.clone().overlay(limits).resolve(&vars).expect("resolve").owner;
        assert_eq!(o.max_unauthenticated_connections, 4);
        assert_eq!(o.connection_share_bytes(), 256 << 10);
        assert_eq!((o.handshake_timeout_ms, o.payload_timeout_ms, o.idle_timeout_ms), (300, 400, 500));
        assert!(OwnerSettings::from_args(["--bogus".to_string()]).is_err());
        assert!(OwnerSettings::from_args(["--help".to_string()]).expect("help").is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_arena_mapping_can_be_turned_off() {
        let dir = temp_dir("share-arena");
        let base = format!("data_dir = {:?}\ntcp = \"off\"\nssd = false\n", dir.display().to_string());
        for toml_line in ["share_arena = false", "shared_memory = false"] {
            let s: OwnerSettings = toml::from_str(&format!("{base}{toml_line}\n")).expect("toml");
            assert!(!s.resolve(&[]).expect("resolve").owner.share_arena, "{toml_line}");
        }
        for flag in ["--no-shared-arena", "--no-shm"] {
            let (flags, _) = OwnerSettings::from_args([flag.to_string()]).expect("args").expect("not help");
            let file: OwnerSettings = toml::from_str(&base).expect("toml");
            assert!(!file.overlay(flags).resolve(&[]).expect("resolve").owner.share_arena, "{flag}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
