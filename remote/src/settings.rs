//! `OwnerSettings`: what a `kvtide-owner` user fills in, and the derivation of a usable default
//! for everything left out: a data directory, a DRAM pool sized from available memory (capped),
//! an SSD tier in the data directory, a Unix socket there, TCP on 127.0.0.1 with a generated
//! token. Owns the `[owner]` group and the layering of `KVTIDE_*` variables, the TOML file and
//! flags over the engine's groups (`kvtide::StoreBuilder`) and its own; never starts anything:
//! `resolve` only decides and creates the data directory and token.
//!
//! Precedence: flags > TOML file > `KVTIDE_*` variables > derived defaults. The engine's
//! settings are the embedded engine's (`[dram]`, `[ssd]`, ... and `KVTIDE_DRAM_BYTES`, ...), so
//! each of them reaches the owner's engine the same way.

use std::net::SocketAddr;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use kvtide::settings::{self, Field, Settings};
use kvtide::StoreBuilder;
use kvtide_tiers::ssd::RecordedLayout;

use crate::auth::Token;
use crate::cluster::EtcdConfig;
use crate::server::{check_mode_with_group, group_id, parse_socket_mode, OwnerConfig};

/// Default TCP address: loopback only.
pub const DEFAULT_TCP: &str = "127.0.0.1:7370";
/// Default HTTP listener (`/metrics`, `/health`, `/ready`, `/version`, `POST /drain`): loopback
/// only. When its port is taken (another owner on the host) the owner runs without it.
pub const DEFAULT_HTTP: &str = "127.0.0.1:7371";
/// The derived DRAM pool: a quarter of available memory, within these bounds.
const DRAM_MIN_BYTES: u64 = 256 << 20;
const DRAM_MAX_BYTES: u64 = 16 << 30;
/// The derived SSD tier: an eighth of the free disk space, within these bounds.
/// (2 GiB free gives the smallest; the engine shrinks segments so every shard still has a few.)
const SSD_MIN_BYTES: u64 = 256 << 20;
const SSD_MAX_BYTES: u64 = 64 << 30;

kvtide::settings_group! {
    /// `[owner]`: the owner process's own settings (`KVTIDE_OWNER_*`).
    pub struct OwnerGroup = "owner" {
        /// Data directory (SSD tier, socket, token). Default `$KVTIDE_DATA_DIR`, else
        /// `$XDG_DATA_HOME/kvtide`, else `~/.local/share/kvtide`.
        data_dir: Option<PathBuf> = None, Path, eg "/tmp/kvtide-owner-settings-example";
        /// Unix socket path, or "off". Default `<data_dir>/owner.sock`.
        unix_socket: Option<String> = None, Text, eg "off";
        /// TCP address, or "off". Default 127.0.0.1:7370.
        tcp: String = DEFAULT_TCP.into(), Text, eg "127.0.0.1:0";
        /// Token file for TCP clients. Default `<data_dir>/token`, created (0600) when missing.
        token_file: Option<PathBuf> = None, Path, eg "/tmp/kvtide-owner-settings-example/other-token";
        /// Require the token on TCP (default true; false is only accepted on loopback).
        tcp_auth: bool = true, Bool, eg "false";
        /// Map the DRAM arena into Unix clients (default true). Every such client can then read
        /// every object in DRAM; turn it off where clients do not trust each other.
        share_arena: bool = true, Bool, eg "off";
        /// An SSD tier in `<data_dir>/ssd` unless `[ssd] dir` names one (default true).
        ssd: bool = true, Bool, eg "false";
        /// Deprecated alias of `http_addr`: an address here sets the HTTP listener (which serves
        /// `GET /metrics` and the rest); "off" (default) leaves `http_addr` in charge.
        metrics_addr: String = "off".into(), Text, eg "0.0.0.0:7371";
        /// Connections served at once. Default: from the open-descriptor limit (raised to its hard
        /// limit at start): (limit - 512 - SSD segment files) / 2, within 64..=16384. An idle
        /// connection costs about 9.5 KiB of the owner's memory and no thread.
        max_connections: Option<usize> = None, Count, eg "64";
        /// TCP connections still in their handshake (default 32); they never take the slots above.
        max_unauthenticated_connections: usize = OwnerConfig::default().max_unauthenticated_connections, Count, eg "4";
        /// Leases one connection may hold (default 4096).
        max_leases_per_connection: u32 = OwnerConfig::default().max_leases_per_connection, Count, eg "128";
        /// Each Unix connection's put window, shared memory for batched puts (default 32 MiB;
        /// 0: puts travel over the socket).
        put_window_bytes: u64 = OwnerConfig::default().put_window_bytes, Bytes, eg "8MiB";
        /// Put windows of all connections together (default 1 GiB).
        max_put_window_bytes: u64 = OwnerConfig::default().max_put_window_bytes, Bytes, eg "256MiB";
        /// Read the put values of Unix clients of the owner's own user straight from their memory,
        /// one copy (default true); other clients, and all with false, put through their window.
        direct_puts: bool = OwnerConfig::default().direct_puts, Bool, eg "false";
        /// Largest frame payload (default 4 MiB).
        max_frame_bytes: u32 = OwnerConfig::default().max_payload_bytes, Bytes, eg "2MiB";
        /// Bytes of a value per data frame (default 1 MiB).
        chunk_bytes: u32 = OwnerConfig::default().chunk_bytes, Bytes, eg "512KiB";
        /// Keys or fragments in one request (default 65536).
        max_items: u32 = OwnerConfig::default().max_items, Count, eg "1024";
        /// Request bytes buffered by all connections together (default 256 MiB).
        max_buffered_bytes: u64 = OwnerConfig::default().max_buffered_bytes, Bytes, eg "64MiB";
        /// Each connection's guaranteed share of them (default max_buffered_bytes /
        /// (2 * max_connections)).
        connection_buffered_bytes: Option<u64> = None, Bytes, eg "256KiB";
        /// Deadline of one blocking read or write (default 30 s).
        io_timeout_ms: u64 = OwnerConfig::default().io_timeout_ms, Count, eg "2000";
        /// Whole handshake, from the accept (default 5 s).
        handshake_timeout_ms: u64 = OwnerConfig::default().handshake_timeout_ms, Count, eg "300";
        /// Each frame, from its first byte (default 10 s).
        payload_timeout_ms: u64 = OwnerConfig::default().payload_timeout_ms, Count, eg "400";
        /// A connection without a request for this long is closed (default 10 min). SIGHUP
        /// applies a new value to connections that go idle afterwards.
        idle_timeout_ms: u64 = OwnerConfig::default().idle_timeout_ms, Count, eg "500";
        /// How long a granted lease stays valid (default 120 s).
        lease_ttl_ms: u32 = OwnerConfig::default().lease_ttl_ms, Count, eg "60000";
        /// How long a connection polls for the next request before it sleeps (default 50 µs
        /// with 8 or more CPUs, else 0).
        spin_us: u64 = OwnerConfig::default().spin_us, Count, eg "75";
        /// How long a stop waits for in-flight requests (default 10 s; at most 2/5 of
        /// stop_budget_ms). SIGHUP applies a new value.
        shutdown_grace_ms: u64 = OwnerConfig::default().shutdown_grace_ms, Count, eg "1000";
        /// The Unix socket's mode, octal (default "0600": the owner's user only). "0660" lets
        /// `socket_group` connect; writable by others is refused.
        socket_mode: String = "0600".into(), Text, eg "0660";
        /// The Unix socket's group: a name or a numeric gid (default: the owner's group). Its
        /// directory must let the group through (a missing one is created 0710 for it).
        socket_group: Option<String> = None, Text, eg "0";
        /// HTTP listener: `GET /metrics`, `/health`, `/ready`, `/version`, `POST /drain` (drain
        /// from loopback peers only). An address (any interface when you name one: it has no
        /// authentication), or "off". Default 127.0.0.1:7371; if that port is taken the owner
        /// runs without HTTP (a warning), while an address you set that cannot be bound stops it.
        http_addr: String = DEFAULT_HTTP.into(), Text, eg "0.0.0.0:7371";
        /// The whole stop, from SIGTERM to the exit (default 25 s, inside Kubernetes' default
        /// 30 s grace): in-flight requests get at most min(shutdown_grace_ms, 2/5 of it), then
        /// DRAM-only objects go to SSD until the budget less a reserve (a tenth, at most 2 s);
        /// what does not fit is logged and absent after the restart. At least 1000. SIGHUP
        /// applies a new value.
        stop_budget_ms: u64 = OwnerConfig::default().stop_budget_ms, Count, eg "15000";
        /// The UCX data plane for TCP clients: "off" (default), "rdma" (rc, dc and ud: RDMA
        /// reads of the arena's read-only registration, served from a confined process; see
        /// docs/owner.md for what a UCX peer reaches) or a UCX transport list (network
        /// transports only; `tcp` needs `ucx_allow_tcp`).
        ucx: String = "off".into(), Text, eg "rdma";
        /// Allow `tcp` in `ucx`. UCX's tcp transport serves one-sided reads and writes in
        /// software at any address a peer names: every host that reaches the owner's UCX port
        /// can read and write the owner's memory. Loopback and trusted networks only (default
        /// false).
        ucx_allow_tcp: bool = false, Bool, eg "true";
        /// UCX workers of the plane's process, each on its own thread; attaching clients are
        /// handed one each, in turn. 0 (default): one per CPU, at most 16. At most 64.
        ucx_workers: usize = 0, Count, eg "8";
    }
}

kvtide::settings_group! {
    /// `[cluster]`: membership in a kvtide cluster on etcd (`KVTIDE_CLUSTER_*`).
    pub struct ClusterGroup = "cluster" {
        /// etcd endpoints, `etcd://HOST:PORT[,HOST:PORT...]` (`etcds://` for TLS), or "off"
        /// (default: no cluster). Shorthand `--cluster`.
        etcd: String = "off".into(), Text, eg "etcd://127.0.0.1:2379";
        /// Cluster name: the owner registers under `/kvtide/<name>/owners/<id>`.
        name: String = "kvtide".into(), Text, eg "prod-kv";
        /// This owner's id; keep it across restarts so its keys map to it again (default: the
        /// advertised address).
        id: Option<String> = None, Text, eg "owner-a";
        /// Address clients on other hosts reach this owner's TCP listener at (default: the TCP
        /// address, when it is not a wildcard). Shorthand `--advertise`.
        advertise: Option<String> = None, Text, eg "10.0.0.5:7370";
        /// Lease TTL: a stopped or partitioned owner leaves the membership this long after its
        /// last keep-alive (default 5 s).
        lease_ttl_s: u64 = crate::cluster::DEFAULT_LEASE_TTL_S, Count, eg "10";
        /// etcd user, when etcd has authentication on (the password is read from
        /// `etcd_password_file`).
        etcd_user: Option<String> = None, Text, eg "kvtide";
        etcd_password_file: Option<PathBuf> = None, Path, eg "/etc/kvtide/etcd-password";
        /// CA certificate (PEM) of etcd's server certificate, for `etcds://` endpoints.
        etcd_ca_file: Option<PathBuf> = None, Path, eg "/etc/kvtide/etcd-ca.pem";
        /// Client certificate and key (PEM), when etcd requires client certificates.
        etcd_cert_file: Option<PathBuf> = None, Path, eg "/etc/kvtide/etcd-client.pem";
        etcd_key_file: Option<PathBuf> = None, Path, eg "/etc/kvtide/etcd-client-key.pem";
        /// Deadline of one etcd call (default 2 s).
        etcd_timeout_ms: u64 = crate::cluster::etcd::DEFAULT_ETCD_TIMEOUT_MS, Count, eg "5000";
    }
}

impl ClusterGroup {
    /// Checks the settings (files are read later, by `etcd_config`).
    pub fn check(&self) -> Result<(), String> {
        if self.etcd.eq_ignore_ascii_case("off") {
            return Ok(());
        }
        EtcdConfig::parse(&self.etcd).map_err(|e| format!("[cluster] etcd: {e}"))?;
        crate::cluster::member::check_name("[cluster] name", &self.name)?;
        if let Some(id) = &self.id {
            crate::cluster::member::check_name("[cluster] id", id)?;
        }
        if let Some(a) = &self.advertise {
            crate::cluster::member::check_address(a).map_err(|e| format!("[cluster] advertise: {e}"))?;
        }
        if self.etcd_user.is_some() != self.etcd_password_file.is_some() {
            return Err("[cluster] etcd_user and etcd_password_file go together".into());
        }
        Ok(())
    }

    /// The etcd client settings (the password read from its file), or None when the cluster is
    /// off.
    pub fn etcd_config(&self) -> Result<Option<EtcdConfig>, String> {
        self.check()?;
        if self.etcd.eq_ignore_ascii_case("off") {
            return Ok(None);
        }
        let mut etcd = EtcdConfig::parse(&self.etcd).map_err(|e| format!("[cluster] etcd: {e}"))?;
        etcd.timeout_ms = self.etcd_timeout_ms;
        etcd.ca_file = self.etcd_ca_file.clone();
        etcd.cert_file = self.etcd_cert_file.clone();
        etcd.key_file = self.etcd_key_file.clone();
        etcd.user = match (&self.etcd_user, &self.etcd_password_file) {
            (Some(user), Some(file)) => {
                let password = std::fs::read_to_string(file)
                    .map_err(|e| format!("[cluster] etcd_password_file {}: {e}", file.display()))?;
                Some((user.clone(), password.trim_end_matches(['\n', '\r']).to_string()))
            }
            _ => None,
        };
        Ok(Some(etcd))
    }
}

/// Everything `kvtide-owner` reads: the engine's groups and `[owner]`, and which settings were
/// given (by a variable, the file or a flag) rather than left to their defaults.
#[derive(Clone, Debug, Default)]
pub struct OwnerSettings {
    pub store: StoreBuilder,
    pub owner: OwnerGroup,
    pub cluster: ClusterGroup,
    given: Vec<(&'static str, &'static str, Source)>,
}

/// Where a setting's value came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// A `KVTIDE_*` variable.
    Variable,
    /// The TOML file (`--config`).
    File,
    /// A command-line flag.
    Flag,
}

impl Settings for OwnerSettings {
    fn groups(&self) -> Vec<(&'static str, &'static [Field])> {
        let mut groups = self.store.groups();
        groups.push((<OwnerGroup as settings::SettingGroup>::NAME, <OwnerGroup as settings::SettingGroup>::FIELDS));
        groups.push((<ClusterGroup as settings::SettingGroup>::NAME, <ClusterGroup as settings::SettingGroup>::FIELDS));
        groups
    }

    fn set(&mut self, group: &str, field: &str, text: &str) -> Result<bool, String> {
        if group == <OwnerGroup as settings::SettingGroup>::NAME {
            settings::SettingGroup::set(&mut self.owner, field, text)
        } else if group == <ClusterGroup as settings::SettingGroup>::NAME {
            settings::SettingGroup::set(&mut self.cluster, field, text)
        } else {
            self.store.set(group, field, text)
        }
    }

    fn show(&self, group: &str, field: &str) -> Option<String> {
        if group == <OwnerGroup as settings::SettingGroup>::NAME {
            settings::SettingGroup::show(&self.owner, field)
        } else if group == <ClusterGroup as settings::SettingGroup>::NAME {
            settings::SettingGroup::show(&self.cluster, field)
        } else {
            self.store.show(group, field)
        }
    }
}

/// The command line: settings it gives (group, field, value), the TOML file to read under them,
/// and what to do besides serving.
#[derive(Clone, Debug, Default)]
pub struct Flags {
    pub config: Option<PathBuf>,
    pub sets: Vec<(&'static str, &'static str, String)>,
    /// `--print-config`: print the effective configuration and exit.
    pub print_config: bool,
    /// `--log-format json`: one JSON object per log line.
    pub log_json: bool,
}

/// What the command line asks for.
#[derive(Debug)]
pub enum Invocation {
    /// Serve (or, with `flags.print_config`, print the configuration) with these settings.
    Serve { settings: Box<OwnerSettings>, flags: Flags },
    /// Print this text (help, version) and exit successfully.
    Print(String),
}

/// What `resolve` decided.
#[derive(Debug)]
pub struct ResolvedOwner {
    pub store: StoreBuilder,
    pub owner: OwnerConfig,
    pub data_dir: PathBuf,
    /// Token file in use (TCP with auth), and whether it was just created.
    pub token_file: Option<(PathBuf, bool)>,
    /// Where to serve HTTP (`/metrics`, `/health`, ...), if anywhere.
    pub http: Option<HttpListen>,
}

/// The HTTP listener's address, and whether the operator chose it: a chosen address that
/// cannot be bound stops the owner, the default one only turns HTTP off (with a warning).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpListen {
    pub addr: SocketAddr,
    pub chosen: bool,
}

/// Flags that stand for a setting besides its own flag: (flag, group, field, the value it sets;
/// None: it takes one).
const SHORTHANDS: &[(&str, &str, &str, Option<&str>)] = &[
    ("unix", "owner", "unix_socket", None),
    ("shards", "runtime", "shards", None),
    ("no-auth", "owner", "tcp_auth", Some("false")),
    ("no-shared-arena", "owner", "share_arena", Some("false")),
    ("no-shm", "owner", "share_arena", Some("false")),
    ("no-ssd", "owner", "ssd", Some("false")),
    ("cluster", "cluster", "etcd", None),
    ("advertise", "cluster", "advertise", None),
];

/// The command-line flag of `[group] field`: `--<group>-<field>` with `-` for `_`, except the
/// owner's own settings, which drop the group (`--data-dir`, `--max-connections`).
pub fn flag_name(group: &str, field: &str) -> String {
    let field = field.replace('_', "-");
    if group == <OwnerGroup as settings::SettingGroup>::NAME {
        field
    } else {
        format!("{group}-{field}")
    }
}

fn value_name(kind: settings::Kind) -> &'static str {
    match kind {
        settings::Kind::Bytes => "SIZE",
        settings::Kind::Count => "N",
        settings::Kind::Bool => "BOOL",
        settings::Kind::Fraction => "X",
        settings::Kind::Text => "TEXT",
        settings::Kind::Path => "PATH",
    }
}

/// A field's documentation on one line.
fn one_line(doc: &str) -> String {
    doc.split_whitespace().collect::<Vec<_>>().join(" ")
}

const AFTER_HELP: &str = "\
Every setting is also a TOML key ([section] key, in the file --config names) and a variable
KVTIDE_<SECTION>_<KEY> (KVTIDE_DRAM_BYTES=8GiB, KVTIDE_OWNER_TCP=off, ...); an unknown one is an
error. Precedence: flags > file > variables > derived defaults. KVTIDE_LOG (else RUST_LOG) sets the
log filter. `kvtide-owner status [unix:PATH | HOST:PORT]` reports the health of a running owner.";

/// The `kvtide-owner` command line: every setting as a flag, the shorthands, and the rest.
fn command() -> clap::Command {
    use clap::{Arg, ArgAction};
    let mut cmd = clap::Command::new("kvtide-owner")
        .version(env!("CARGO_PKG_VERSION"))
        .about("Serve a kvtide store to other processes (Unix socket + shared memory) and hosts (TCP)")
        .after_help(AFTER_HELP)
        .arg(Arg::new("config").long("config").value_name("FILE").help("TOML settings file"))
        .arg(
            Arg::new("print-config")
                .long("print-config")
                .action(ArgAction::SetTrue)
                .help("Print the effective configuration (each value with where it came from) and exit"),
        )
        .arg(
            Arg::new("log-format")
                .long("log-format")
                .value_name("FORMAT")
                .value_parser(["text", "json"])
                .help("Log lines as text (default) or JSON objects"),
        );
    for (flag, group, field, fixed) in SHORTHANDS {
        let arg = Arg::new(*flag).long(*flag).help_heading("Shorthands");
        cmd = cmd.arg(match fixed {
            Some(value) => arg.action(ArgAction::SetTrue).help(format!("[{group}] {field} = {value}")),
            None => arg.value_name("VALUE").help(format!("[{group}] {field}")),
        });
    }
    for (group, fields) in OwnerSettings::default().groups() {
        for f in fields {
            let name = flag_name(group, f.name);
            cmd = cmd.arg(
                Arg::new(name.clone())
                    .long(name)
                    .value_name(value_name(f.kind))
                    .help(one_line(f.doc))
                    .help_heading(format!("[{group}]")),
            );
        }
    }
    cmd
}

/// The help text `kvtide-owner --help` prints.
pub fn usage() -> String {
    command().render_long_help().to_string()
}

impl OwnerSettings {
    /// Parses command-line flags (without the program name). `Ok(None)`: help or the version
    /// was asked for, and printed into the `Err`-free text of `parse_command_line`.
    pub fn parse_flags(args: impl IntoIterator<Item = String>) -> Result<Option<Flags>, String> {
        Ok(Self::parse_command_line(args)?.ok())
    }

    /// Parses the command line into flags, or (`Err` inside) the text of `--help` / `--version`.
    fn parse_command_line(args: impl IntoIterator<Item = String>) -> Result<Result<Flags, String>, String> {
        let argv = std::iter::once("kvtide-owner".to_string()).chain(args);
        let matches = match command().try_get_matches_from(argv) {
            Ok(m) => m,
            Err(e) => {
                return match e.kind() {
                    clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => {
                        Ok(Err(e.render().to_string()))
                    }
                    _ => Err(e.render().to_string().trim_end().trim_start_matches("error: ").to_string()),
                };
            }
        };
        let given = |id: &str| matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
        let mut flags = Flags {
            config: matches.get_one::<String>("config").map(PathBuf::from),
            print_config: matches.get_flag("print-config"),
            log_json: matches.get_one::<String>("log-format").is_some_and(|f| f == "json"),
            ..Flags::default()
        };
        for (flag, group, field, fixed) in SHORTHANDS {
            if given(flag) {
                let value = match fixed {
                    Some(v) => v.to_string(),
                    None => matches.get_one::<String>(flag).cloned().unwrap_or_default(),
                };
                flags.sets.push((group, field, value));
            }
        }
        for (group, fields) in OwnerSettings::default().groups() {
            for f in fields {
                let id = flag_name(group, f.name);
                if given(&id) {
                    flags.sets.push((group, f.name, matches.get_one::<String>(&id).cloned().unwrap_or_default()));
                }
            }
        }
        Ok(Ok(flags))
    }

    /// Variables, then the TOML text, then the flags, each over the previous (the file named
    /// by `flags.config` is not read here: pass its text).
    pub fn layered(vars: &[(String, String)], toml: Option<&str>, flags: &Flags) -> Result<OwnerSettings, String> {
        let mut s = OwnerSettings::default();
        let mut given: Vec<(&'static str, &'static str, Source)> =
            settings::apply_variables(&mut s, vars.iter().cloned())?
                .into_iter()
                .map(|(g, f)| (g, f, Source::Variable))
                .collect();
        if let Some(text) = toml {
            given.extend(settings::apply_toml(&mut s, text)?.into_iter().map(|(g, f)| (g, f, Source::File)));
        }
        for (group, field, text) in &flags.sets {
            let setting = format!("--{} ([{group}] {field})", flag_name(group, field));
            if !s.set(group, field, text).map_err(|why| format!("{setting} {text:?}: {why}"))? {
                return Err(format!("no setting {setting}"));
            }
            given.push((group, field, Source::Flag));
        }
        s.given = given;
        Ok(s)
    }

    /// Flags, the file they name and the process's variables: what `kvtide-owner` runs with,
    /// or the help or version text to print.
    pub fn load(args: impl IntoIterator<Item = String>, vars: &[(String, String)]) -> Result<Invocation, String> {
        let flags = match OwnerSettings::parse_command_line(args)? {
            Ok(flags) => flags,
            Err(text) => return Ok(Invocation::Print(text)),
        };
        let text = match &flags.config {
            Some(path) => {
                Some(std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?)
            }
            None => None,
        };
        let settings = OwnerSettings::layered(vars, text.as_deref(), &flags).map_err(|e| match &flags.config {
            Some(path) => format!("{}: {e}", path.display()),
            None => e,
        })?;
        Ok(Invocation::Serve { settings: Box::new(settings), flags })
    }

    /// Where `[group] field` was given, if it was.
    pub fn source_of(&self, group: &str, field: &str) -> Option<Source> {
        self.given.iter().rev().find(|(g, f, _)| *g == group && *f == field).map(|(_, _, s)| *s)
    }

    /// The effective configuration after `resolve`, as TOML: every setting with its value and,
    /// in a comment, where it came from (flag, file, variable, derived at start, or default).
    pub fn effective_config(&self, resolved: &ResolvedOwner) -> String {
        let defaults = OwnerSettings::default();
        // What resolve derived for the owner's own settings.
        let mut owner = self.owner.clone();
        owner.data_dir = Some(resolved.data_dir.clone());
        owner.unix_socket =
            Some(resolved.owner.unix_socket.as_ref().map_or_else(|| "off".to_string(), |p| p.display().to_string()));
        owner.token_file = resolved.token_file.as_ref().map(|(p, _)| p.clone());
        owner.connection_buffered_bytes = Some(resolved.owner.connection_share_bytes());
        owner.max_connections = Some(resolved.owner.max_connections);
        let effective =
            OwnerSettings { store: resolved.store.clone(), owner, cluster: self.cluster.clone(), given: Vec::new() };
        let mut out =
            String::from("# kvtide-owner: effective configuration (flag > file > variable > derived > default)\n");
        for (group, fields) in effective.groups() {
            out.push_str(&format!("\n[{group}]\n"));
            for f in fields {
                let value = effective.show(group, f.name).unwrap_or_default();
                let source = match self.source_of(group, f.name) {
                    Some(Source::Flag) => format!("flag --{}", flag_name(group, f.name)),
                    Some(Source::File) => "file".to_string(),
                    Some(Source::Variable) => format!("variable {}", settings::variable_name(group, f.name)),
                    None if defaults.show(group, f.name) != Some(value.clone()) => "derived".to_string(),
                    None => "default".to_string(),
                };
                match toml_value(&value) {
                    Some(v) => out.push_str(&format!("{} = {v}  # {source}\n", f.name)),
                    None => out.push_str(&format!("# {} unset  # {source}\n", f.name)),
                }
            }
        }
        out
    }

    /// The settings whose value differs in `newer` (a re-read of the same sources), in
    /// declaration order.
    pub fn changed_settings(&self, newer: &OwnerSettings) -> Vec<(&'static str, &'static str)> {
        let mut changed = Vec::new();
        for (group, fields) in self.groups() {
            for f in fields {
                if self.show(group, f.name) != newer.show(group, f.name) {
                    changed.push((group, f.name));
                }
            }
        }
        changed
    }

    /// True when `[group] field` was given rather than left to its default.
    pub fn is_given(&self, group: &str, field: &str) -> bool {
        self.given.iter().any(|(g, f, _)| *g == group && *f == field)
    }

    /// Derives everything left out, creates the data directory (0700) and, for TCP with
    /// authentication, the token file when missing. `vars` are the environment variables.
    pub fn resolve(&self, vars: &[(String, String)]) -> Result<ResolvedOwner, String> {
        let env = |name: &str| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        let o = &self.owner;
        let data_dir = match (&o.data_dir, env("KVTIDE_DATA_DIR")) {
            (Some(d), _) => d.clone(),
            (None, Some(d)) => PathBuf::from(d),
            (None, None) => default_data_dir(&env),
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&data_dir)
            .map_err(|e| format!("cannot create data directory {}: {e}", data_dir.display()))?;

        let store = self.derived_store(&data_dir)?;
        let off = |v: &str| v.eq_ignore_ascii_case("off");
        let unix_socket = match o.unix_socket.as_deref() {
            Some(v) if off(v) => None,
            Some(v) => Some(PathBuf::from(v)),
            None => Some(data_dir.join("owner.sock")),
        };
        let tcp = if off(&o.tcp) {
            None
        } else {
            Some(o.tcp.parse::<SocketAddr>().map_err(|e| format!("[owner] tcp {:?}: {e}", o.tcp))?)
        };
        let (unix_socket_mode, unix_socket_group) = self.socket_permissions()?;
        let mut owner = OwnerConfig {
            unix_socket,
            tcp,
            share_arena: o.share_arena,
            unix_socket_mode,
            unix_socket_group,
            max_connections: o.max_connections.unwrap_or_else(|| derived_max_connections(&store)),
            max_unauthenticated_connections: o.max_unauthenticated_connections,
            max_leases_per_connection: o.max_leases_per_connection,
            put_window_bytes: o.put_window_bytes,
            max_put_window_bytes: o.max_put_window_bytes,
            direct_puts: o.direct_puts,
            max_payload_bytes: o.max_frame_bytes,
            chunk_bytes: o.chunk_bytes,
            max_items: o.max_items,
            max_buffered_bytes: o.max_buffered_bytes,
            connection_buffered_bytes: o.connection_buffered_bytes,
            io_timeout_ms: o.io_timeout_ms,
            handshake_timeout_ms: o.handshake_timeout_ms,
            payload_timeout_ms: o.payload_timeout_ms,
            idle_timeout_ms: o.idle_timeout_ms,
            lease_ttl_ms: o.lease_ttl_ms,
            shutdown_grace_ms: o.shutdown_grace_ms,
            stop_budget_ms: o.stop_budget_ms,
            spin_us: o.spin_us,
            ucx_transports: crate::ucx::Transports::from_setting(&o.ucx),
            ucx_allow_tcp: o.ucx_allow_tcp,
            ucx_workers: o.ucx_workers,
            ..OwnerConfig::default()
        };
        let mut token_file = None;
        if tcp.is_some() {
            if !o.tcp_auth {
                owner.allow_unauthenticated_loopback = true;
            } else {
                let path = o.token_file.clone().unwrap_or_else(|| data_dir.join("token"));
                let (token, created) = Token::load_or_create(&path)?;
                owner.tcp_token = Some(token);
                token_file = Some((path, created));
            }
        }
        let http = self.http_listen()?;
        self.cluster.check()?;
        Ok(ResolvedOwner { store, owner, data_dir, token_file, http })
    }
}

impl OwnerSettings {
    /// `[owner] socket_mode` and `socket_group` (a gid: a number as it is, a name looked up),
    /// checked alone and together.
    fn socket_permissions(&self) -> Result<(u32, Option<u32>), String> {
        let o = &self.owner;
        let mode = parse_socket_mode(&o.socket_mode).map_err(|e| format!("[owner] socket_mode: {e}"))?;
        let group = match &o.socket_group {
            Some(text) => Some(group_id(text).map_err(|e| format!("[owner] socket_group: {e}"))?),
            None => None,
        };
        check_mode_with_group(mode, group).map_err(|e| format!("[owner] socket_group: {e}"))?;
        Ok((mode, group))
    }
}

/// The connection limit when none is given: what this process's descriptor limit (raised at
/// start) leaves beside the store's files.
fn derived_max_connections(store: &StoreBuilder) -> usize {
    let segment_files = match &store.ssd.dir {
        Some(_) => store.ssd.bytes / store.ssd.segment_bytes.max(1),
        None => 0,
    };
    let limit = crate::sock::descriptor_limit().unwrap_or(1024);
    OwnerConfig::connections_for_descriptors(limit, segment_files)
}

impl OwnerSettings {
    /// The store's settings with what was left out derived: the DRAM size, and unless the SSD
    /// tier is off, its directory under `data_dir` and its size (an earlier start's recorded
    /// layout kept).
    fn derived_store(&self, data_dir: &Path) -> Result<StoreBuilder, String> {
        let o = &self.owner;
        let mut store = self.store.clone();
        if !self.is_given("dram", "bytes") {
            store.dram.bytes = derived_dram_bytes();
        }
        if o.ssd && store.ssd.dir.is_none() && !self.ssd_asked_for() && !io_uring_usable(&store) {
            tracing::warn!(
                "io_uring is off or refused here (container seccomp profiles block io_uring_setup): the SSD tier \
                 needs it, so this owner runs DRAM only (its shards park with poll(2)) and a restart starts empty; \
                 for an SSD tier allow io_uring_setup, io_uring_enter and io_uring_register (see deploy/Dockerfile)"
            );
            store.ssd.dir = None;
        } else if o.ssd && store.ssd.dir.is_none() {
            let ssd_dir = data_dir.join("ssd");
            // A directory made by an earlier start keeps its layout: sizes derived from today's
            // free space would differ and refuse it.
            let recorded = RecordedLayout::read(&ssd_dir).map_err(|e| e.to_string())?;
            if let Some(layout) = recorded {
                if !self.is_given("ssd", "segment_bytes") {
                    store.ssd.segment_bytes = layout.segment_bytes;
                }
                if !self.is_given("runtime", "shards") {
                    store.runtime.shards = Some(layout.shards);
                }
            }
            let bytes = match (self.is_given("ssd", "bytes"), recorded) {
                (true, _) => Some(store.ssd.bytes),
                (false, Some(layout)) => Some(layout.ssd_bytes()),
                (false, None) => derived_ssd_bytes(data_dir),
            };
            if let Some(bytes) = bytes {
                store.ssd.bytes = bytes;
                store.ssd.dir = Some(ssd_dir);
            } else {
                tracing::warn!(dir = %data_dir.display(), "too little free disk space for an SSD tier; DRAM only");
            }
        } else if !o.ssd {
            store.ssd.dir = None;
        }
        Ok(store)
    }

    /// True when the SSD tier was asked for rather than derived: `[owner] ssd` or an `[ssd]`
    /// size given. Then a missing io_uring is an error, not a quiet fall back to DRAM only.
    fn ssd_asked_for(&self) -> bool {
        self.is_given("owner", "ssd") || self.is_given("ssd", "bytes") || self.is_given("ssd", "dir")
    }

    /// The HTTP listener's address: `http_addr`, or the deprecated `metrics_addr` when it names
    /// one (both naming different addresses is refused); None when off.
    fn http_listen(&self) -> Result<Option<HttpListen>, String> {
        let o = &self.owner;
        let off = |v: &str| v.eq_ignore_ascii_case("off");
        let http_given = self.is_given("owner", "http_addr");
        let (key, text, chosen) = if off(&o.metrics_addr) {
            ("http_addr", &o.http_addr, http_given)
        } else {
            if http_given && o.http_addr != o.metrics_addr {
                return Err(format!(
                    "[owner] metrics_addr {:?} (deprecated) and http_addr {:?} name different listeners: set http_addr only",
                    o.metrics_addr, o.http_addr
                ));
            }
            tracing::warn!("[owner] metrics_addr is deprecated: it sets http_addr, the one HTTP listener");
            ("metrics_addr", &o.metrics_addr, true)
        };
        if off(text) {
            return Ok(None);
        }
        let addr: SocketAddr =
            text.parse().map_err(|e| format!("[owner] {key} {text:?}: {e} (an IP:PORT, or \"off\")"))?;
        Ok(Some(HttpListen { addr, chosen }))
    }
}

/// A setting's value as `show` writes it (`{:?}`), as a TOML value; None for an unset option.
fn toml_value(debug: &str) -> Option<String> {
    if debug == "None" {
        return None;
    }
    let inner = debug.strip_prefix("Some(").and_then(|v| v.strip_suffix(')')).unwrap_or(debug);
    Some(inner.to_string())
}

/// The configuration reference in docs/configuration.md: every setting of the engine and the
/// owner, from the declarations themselves (name, TOML key, variable, flag, default, doc).
pub fn configuration_reference() -> String {
    let defaults = OwnerSettings::default();
    let mut out = String::new();
    for (group, fields) in defaults.groups() {
        let scope = if group == <OwnerGroup as settings::SettingGroup>::NAME {
            "kvtide-owner only"
        } else {
            "embedded engine and kvtide-owner"
        };
        out.push_str(&format!("### `[{group}]` ({scope})\n\n"));
        out.push_str("| key | variable | flag | default | meaning |\n|---|---|---|---|---|\n");
        for f in fields {
            let default = defaults
                .show(group, f.name)
                .and_then(|v| toml_value(&v))
                .map_or_else(|| "unset".to_string(), |v| format!("`{v}`"));
            out.push_str(&format!(
                "| `{}` | `{}` | `--{}` | {} | {} |\n",
                f.name,
                settings::variable_name(group, f.name),
                flag_name(group, f.name),
                default,
                one_line(f.doc).replace('|', "\\|"),
            ));
        }
        out.push('\n');
    }
    out
}

/// The Unix socket of an owner started with defaults (`kvtide-owner status`): the default data
/// directory's `owner.sock`, `$KVTIDE_DATA_DIR` first.
pub fn default_socket(vars: &[(String, String)]) -> PathBuf {
    let env = |name: &str| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let dir = env("KVTIDE_DATA_DIR").map(PathBuf::from).unwrap_or_else(|| default_data_dir(&env));
    dir.join("owner.sock")
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

/// Whether the store's shards can have io_uring: it is on (`[runtime] io_uring`) and this
/// process may set up a ring (a seccomp profile may refuse `io_uring_setup`).
fn io_uring_usable(store: &StoreBuilder) -> bool {
    if !store.runtime.io_uring {
        return false;
    }
    // struct io_uring_params: 120 bytes the kernel reads (zero: no flags) and fills in.
    let mut params = [0u64; 15];
    // SAFETY: io_uring_setup with one entry and a zeroed, writable io_uring_params of the size the
    // kernel expects; the descriptor it returns is ours and closed at once.
    let fd = unsafe { libc::syscall(libc::SYS_io_uring_setup, 1u32, params.as_mut_ptr()) };
    if fd < 0 {
        let refused =
            matches!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EPERM | libc::ENOSYS | libc::EACCES));
        // Other errors (no memory, too many files) are the engine's to report when it opens.
        return !refused;
    }
    // SAFETY: closes the ring descriptor io_uring_setup just returned, which nothing else holds.
    unsafe { libc::close(fd as libc::c_int) };
    true
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
    ssd_bytes_for_free((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// The SSD tier for `free_bytes` of free disk space: an eighth of it within bounds, or None.
fn ssd_bytes_for_free(free_bytes: u64) -> Option<u64> {
    let want = free_bytes / 8;
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

    fn vars(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn flags(args: &[&str]) -> Flags {
        OwnerSettings::parse_flags(args.iter().map(|a| a.to_string())).expect("args").expect("not help")
    }

    fn in_dir(dir: &Path, rest: &str) -> String {
        format!("[owner]\ndata_dir = {:?}\n{rest}", dir.display().to_string())
    }

    #[test]
    fn the_derived_ssd_tier_is_an_eighth_of_the_free_space_within_bounds() {
        assert_eq!(ssd_bytes_for_free((2 << 30) - 1), None, "DRAM only below 2 GiB free");
        assert_eq!(ssd_bytes_for_free(2 << 30), Some(256 << 20));
        assert_eq!(ssd_bytes_for_free(100 << 30), Some(100 << 27));
        assert_eq!(ssd_bytes_for_free(1 << 40), Some(64 << 30));
        assert_eq!(ssd_bytes_for_free(u64::MAX), Some(64 << 30));
    }

    #[test]
    fn defaults_are_usable_and_secure() {
        let dir = temp_dir("defaults");
        let s = OwnerSettings::layered(&[], Some(&in_dir(&dir, "")), &Flags::default()).expect("settings");
        let r = s.resolve(&[]).expect("resolve");
        assert_eq!(r.owner.unix_socket, Some(dir.join("owner.sock")));
        assert_eq!(r.owner.tcp, Some(DEFAULT_TCP.parse().expect("addr")));
        assert!(r.owner.tcp_token.is_some(), "TCP requires a token by default");
        assert!(r.token_file.as_ref().is_some_and(|(_, created)| *created));
        assert!((DRAM_MIN_BYTES..=DRAM_MAX_BYTES).contains(&r.store.dram.bytes));
        let o = &r.owner;
        assert!((64..=16_384).contains(&o.max_connections), "derived from the descriptor limit: {}", o.max_connections);
        assert_eq!(o.max_unauthenticated_connections, 32);
        assert_eq!(o.max_buffered_bytes, 256 << 20);
        assert_eq!(o.connection_share_bytes(), (256 << 20) / (2 * o.max_connections as u64));
        assert_eq!((o.unix_socket_mode, o.unix_socket_group), (0o600, None), "owner-only by default");
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
    fn the_default_connection_limit_follows_the_descriptor_limit() {
        assert_eq!(OwnerConfig::connections_for_descriptors(1024, 0), 256, "the usual soft limit");
        assert_eq!(OwnerConfig::connections_for_descriptors(20_000, 0), 9_744);
        assert_eq!(OwnerConfig::connections_for_descriptors(20_000, 2_048), 8_720, "SSD segment files count");
        assert_eq!(OwnerConfig::connections_for_descriptors(65_536, 0), 16_384, "capped");
        assert_eq!(OwnerConfig::connections_for_descriptors(u64::MAX, u64::MAX), 64);
        assert_eq!(OwnerConfig::connections_for_descriptors(100, 0), 64, "never below 64");
        // The owner resolves it from this process's limit, and a given value wins.
        let dir = temp_dir("max-connections");
        let base = in_dir(&dir, "tcp = \"off\"\nssd = false\n");
        let s = OwnerSettings::layered(&[], Some(&base), &Flags::default()).expect("settings");
        let limit = crate::sock::descriptor_limit().expect("getrlimit");
        assert_eq!(
            s.resolve(&[]).expect("resolve").owner.max_connections,
            OwnerConfig::connections_for_descriptors(limit, 0)
        );
        let s = OwnerSettings::layered(&[], Some(&base), &flags(&["--max-connections", "300"])).expect("settings");
        assert_eq!(s.resolve(&[]).expect("resolve").owner.max_connections, 300);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn socket_mode_and_group_are_checked_at_start() {
        let dir = temp_dir("socket-perms");
        let base = in_dir(&dir, "tcp = \"off\"\nssd = false\n");
        let resolve = |extra: &str| {
            OwnerSettings::layered(&[], Some(&format!("{base}{extra}")), &Flags::default())
                .expect("settings")
                .resolve(&[])
                .map(|r| (r.owner.unix_socket_mode, r.owner.unix_socket_group))
        };
        assert_eq!(resolve("socket_mode = \"0660\"\nsocket_group = \"root\"\n"), Ok((0o660, Some(0))));
        assert_eq!(resolve("socket_mode = \"0660\"\nsocket_group = \"4242\"\n"), Ok((0o660, Some(4242))));
        assert_eq!(resolve("socket_mode = \"660\"\n"), Ok((0o660, None)));
        for (extra, why) in [
            ("socket_mode = \"0666\"\n", "lets every user of the host connect"),
            ("socket_mode = \"01660\"\n", "beyond the permission bits"),
            ("socket_mode = \"rw-rw----\"\n", "not an octal mode"),
            ("socket_mode = \"0660\"\nsocket_group = \"kvtide-no-such-group\"\n", "unknown group"),
            ("socket_group = \"root\"\n", "does not let the group connect"),
        ] {
            let e = resolve(extra).expect_err(extra);
            assert!(e.starts_with("[owner] socket_") && e.contains(why), "{extra}: {e}");
        }
        let env = vars(&[("KVTIDE_OWNER_SOCKET_MODE", "0660"), ("KVTIDE_OWNER_SOCKET_GROUP", "0")]);
        let r = OwnerSettings::layered(&env, Some(&base), &Flags::default()).expect("settings").resolve(&env);
        assert_eq!(r.map(|r| (r.owner.unix_socket_mode, r.owner.unix_socket_group)), Ok((0o660, Some(0))));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_data_directory_keeps_the_layout_of_its_first_start() {
        let dir = temp_dir("recorded-layout");
        // An earlier start made the SSD directory with 3 shards of 5 x 4 MiB segments.
        kvtide_tiers::ssd::DataDir::open(&dir.join("ssd"), 60 << 20, 3, 4 << 20).expect("first layout");
        let s =
            OwnerSettings::layered(&[], Some(&in_dir(&dir, "tcp = \"off\"\n")), &Flags::default()).expect("settings");
        let r = s.resolve(&[]).expect("resolve");
        assert_eq!(r.store.ssd.dir, Some(dir.join("ssd")));
        assert_eq!(
            (r.store.ssd.bytes, r.store.ssd.segment_bytes, r.store.runtime.shards),
            (60 << 20, 4 << 20, Some(3))
        );
        // Explicit settings win (and are checked against the directory when the store opens).
        let f = flags(&["--ssd-bytes", "120MiB", "--shards", "2"]);
        let s = OwnerSettings::layered(&[], Some(&in_dir(&dir, "tcp = \"off\"\n")), &f).expect("settings");
        let r = s.resolve(&[]).expect("resolve");
        assert_eq!((r.store.ssd.bytes, r.store.runtime.shards), (120 << 20, Some(2)));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn flags_override_file_override_env() {
        let dir = temp_dir("override");
        let file =
            in_dir(&dir, "tcp = \"off\"\nssd = false\n[dram]\nbytes = \"64MiB\"\n[runtime]\nmax_key_bytes = 200\n");
        let f = flags(&["--dram-bytes", "32MiB", "--shards=2", "--unix", "off", "--tcp", "127.0.0.1:0", "--no-auth"]);
        assert!(f.config.is_none());
        let env = vars(&[("KVTIDE_DRAM_BYTES", "1GiB"), ("KVTIDE_RUNTIME_MAX_KEY_BYTES", "100")]);
        let s = OwnerSettings::layered(&env, Some(&file), &f).expect("settings");
        let r = s.resolve(&env).expect("resolve");
        assert_eq!(r.store.dram.bytes, 32 << 20);
        assert_eq!(r.store.runtime.shards, Some(2));
        assert_eq!(r.store.runtime.max_key_bytes, 200);
        assert!(r.store.ssd.dir.is_none());
        assert!(r.owner.unix_socket.is_none());
        assert!(r.owner.allow_unauthenticated_loopback && r.owner.tcp_token.is_none());
        assert!(r.owner.share_arena, "shared by default");
        let limits = in_dir(
            &dir,
            "tcp = \"off\"\nssd = false\nmax_unauthenticated_connections = 4\nconnection_buffered_bytes = \
             \"256KiB\"\nhandshake_timeout_ms = 300\npayload_timeout_ms = 400\nidle_timeout_ms = 500\n",
        );
        let o =
            OwnerSettings::layered(&env, Some(&limits), &f).expect("settings").resolve(&env).expect("resolve").owner;
        assert_eq!(o.max_unauthenticated_connections, 4);
        assert_eq!(o.connection_share_bytes(), 256 << 10);
        assert_eq!((o.handshake_timeout_ms, o.payload_timeout_ms, o.idle_timeout_ms), (300, 400, 500));
        assert!(OwnerSettings::parse_flags(["--bogus".to_string()]).is_err());
        assert!(OwnerSettings::parse_flags(["--help".to_string()]).expect("help").is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_arena_mapping_can_be_turned_off() {
        let dir = temp_dir("share-arena");
        let base = in_dir(&dir, "tcp = \"off\"\nssd = false\n");
        let s = OwnerSettings::layered(&[], Some(&format!("{base}share_arena = false\n")), &Flags::default())
            .expect("settings");
        assert!(!s.resolve(&[]).expect("resolve").owner.share_arena, "[owner] share_arena = false");
        let env = vars(&[("KVTIDE_OWNER_SHARE_ARENA", "off")]);
        let s = OwnerSettings::layered(&env, Some(&base), &Flags::default()).expect("settings");
        assert!(!s.resolve(&env).expect("resolve").owner.share_arena, "KVTIDE_OWNER_SHARE_ARENA=off");
        for flag in ["--no-shared-arena", "--no-shm"] {
            let s = OwnerSettings::layered(&[], Some(&base), &flags(&[flag])).expect("settings");
            assert!(!s.resolve(&[]).expect("resolve").owner.share_arena, "{flag}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn every_setting_reaches_the_owner_as_a_variable_and_in_toml() {
        let defaults = OwnerSettings::default();
        let mut env = Vec::new();
        let mut text = String::new();
        for (group, fields) in defaults.groups() {
            text.push_str(&format!("[{group}]\n"));
            for f in fields {
                env.push((settings::variable_name(group, f.name), f.example.to_string()));
                let value = match f.kind {
                    settings::Kind::Count | settings::Kind::Fraction => f.example.to_string(),
                    settings::Kind::Bool => settings::parse_bool(f.example).expect("boolean").to_string(),
                    _ => format!("{:?}", f.example),
                };
                text.push_str(&format!("{} = {value}\n", f.name));
            }
        }
        let by_env = OwnerSettings::layered(&env, None, &Flags::default()).expect("every variable");
        let by_toml = OwnerSettings::layered(&[], Some(&text), &Flags::default()).expect("every key");
        let mut count = 0;
        for (group, fields) in defaults.groups() {
            for f in fields {
                let default = defaults.show(group, f.name);
                let (e, t) = (by_env.show(group, f.name), by_toml.show(group, f.name));
                assert_ne!(e, default, "[{group}] {}: the variable did not arrive", f.name);
                assert_eq!(e, t, "[{group}] {}: the variable and the TOML key disagree", f.name);
                assert!(by_env.is_given(group, f.name) && by_toml.is_given(group, f.name));
                count += 1;
            }
        }
        assert_eq!(
            count,
            StoreBuilder::fields().len()
                + <OwnerGroup as settings::SettingGroup>::FIELDS.len()
                + <ClusterGroup as settings::SettingGroup>::FIELDS.len()
        );
        // What the owner resolves carries them (its data directory is the example's).
        let r = by_env.resolve(&env).expect("resolve");
        assert_eq!(r.store.dram.bytes, 64 << 20, "given, so not derived");
        assert_eq!(r.store.ssd.bytes, 256 << 20);
        assert!(r.store.ssd.dir.is_none(), "[owner] ssd = false: DRAM only, even with [ssd] dir");
        assert!(r.owner.unix_socket.is_none() && r.owner.allow_unauthenticated_loopback);
        assert_eq!((r.owner.max_connections, r.owner.max_items, r.owner.shutdown_grace_ms), (64, 1024, 1000));
        assert_eq!((r.owner.max_payload_bytes, r.owner.chunk_bytes), (2 << 20, 512 << 10));
        assert_eq!(r.http, Some(HttpListen { addr: "0.0.0.0:7371".parse().expect("addr"), chosen: true }));
        let _ = std::fs::remove_dir_all("/tmp/kvtide-owner-settings-example");
    }

    /// `http_addr` by default (not chosen: a taken port only turns HTTP off), set, or off;
    /// `metrics_addr` as its alias; the two naming different listeners, or a bad address, refused.
    #[test]
    fn the_http_listener_comes_from_http_addr_or_its_deprecated_alias() {
        let listen = |env: &[(&str, &str)]| {
            OwnerSettings::layered(&vars(env), None, &Flags::default()).expect("settings").http_listen()
        };
        let at = |addr: &str, chosen| Ok(Some(HttpListen { addr: addr.parse().expect("addr"), chosen }));
        assert_eq!(listen(&[]), at(DEFAULT_HTTP, false));
        assert_eq!(listen(&[("KVTIDE_OWNER_HTTP_ADDR", DEFAULT_HTTP)]), at(DEFAULT_HTTP, true));
        assert_eq!(listen(&[("KVTIDE_OWNER_HTTP_ADDR", "0.0.0.0:9100")]), at("0.0.0.0:9100", true));
        assert_eq!(listen(&[("KVTIDE_OWNER_HTTP_ADDR", "OFF")]), Ok(None));
        assert_eq!(listen(&[("KVTIDE_OWNER_METRICS_ADDR", "127.0.0.1:9464")]), at("127.0.0.1:9464", true));
        let same = [("KVTIDE_OWNER_METRICS_ADDR", "127.0.0.1:9464"), ("KVTIDE_OWNER_HTTP_ADDR", "127.0.0.1:9464")];
        assert_eq!(listen(&same), at("127.0.0.1:9464", true));
        let both = [("KVTIDE_OWNER_METRICS_ADDR", "127.0.0.1:9464"), ("KVTIDE_OWNER_HTTP_ADDR", "127.0.0.1:9465")];
        assert!(listen(&both).is_err_and(|e| e.contains("different listeners")));
        assert!(listen(&[("KVTIDE_OWNER_HTTP_ADDR", "localhost")]).is_err_and(|e| e.contains("http_addr")));
    }

    #[test]
    fn every_setting_is_a_flag_and_the_printed_configuration_reads_back() {
        let defaults = OwnerSettings::default();
        let mut args = Vec::new();
        let mut env = Vec::new();
        for (group, fields) in defaults.groups() {
            for f in fields {
                args.push(format!("--{}", flag_name(group, f.name)));
                args.push(f.example.to_string());
                env.push((settings::variable_name(group, f.name), f.example.to_string()));
            }
        }
        let by_flags = OwnerSettings::layered(&[], None, &flags(&args.iter().map(String::as_str).collect::<Vec<_>>()))
            .expect("every flag");
        let by_env = OwnerSettings::layered(&env, None, &Flags::default()).expect("every variable");
        for (group, fields) in defaults.groups() {
            for f in fields {
                assert_eq!(by_flags.show(group, f.name), by_env.show(group, f.name), "--{}", flag_name(group, f.name));
                assert_eq!(by_flags.source_of(group, f.name), Some(Source::Flag));
            }
        }
        // Flags beat variables, and the printed configuration says where each value came from.
        let dir = temp_dir("print-config");
        let env = vars(&[("KVTIDE_DRAM_EVICTION", "lru"), ("KVTIDE_RUNTIME_MAX_KEY_BYTES", "100")]);
        let file = in_dir(&dir, "ssd = false\n");
        let f = flags(&["--runtime-max-key-bytes", "300", "--tcp", "off", "--print-config", "--log-format", "json"]);
        assert!(f.print_config && f.log_json);
        let s = OwnerSettings::layered(&env, Some(&file), &f).expect("settings");
        let r = s.resolve(&env).expect("resolve");
        let printed = s.effective_config(&r);
        assert!(printed.contains("max_key_bytes = 300  # flag --runtime-max-key-bytes"), "{printed}");
        assert!(printed.contains("eviction = \"lru\"  # variable KVTIDE_DRAM_EVICTION"), "{printed}");
        assert!(printed.contains("ssd = false  # file"), "{printed}");
        assert!(
            printed.contains(&format!("unix_socket = {:?}  # derived", dir.join("owner.sock").display().to_string()))
        );
        assert!(printed.contains("low_watermark = 0.85  # default"), "{printed}");
        // It is a settings file: read back, it gives the same effective values.
        let again = OwnerSettings::layered(&[], Some(&printed), &Flags::default()).expect("the printed file reads");
        let r2 = again.resolve(&[]).expect("resolve");
        assert_eq!(
            again.effective_config(&r2).lines().filter(|l| !l.starts_with('#')).count(),
            printed.lines().filter(|l| !l.starts_with('#')).count()
        );
        assert_eq!((r2.store.runtime.max_key_bytes, r2.owner.unix_socket), (300, r.owner.unix_socket));
        // Bad flags are errors; help and the version are text to print.
        assert!(OwnerSettings::parse_flags(["--dram-bytes".to_string()]).is_err(), "a value is needed");
        assert!(OwnerSettings::layered(&[], None, &flags(&["--dram-bytes", "lots"])).is_err());
        for ask in ["--help", "--version"] {
            match OwnerSettings::load([ask.to_string()], &[]).expect(ask) {
                Invocation::Print(text) => assert!(text.contains(if ask == "--help" { "--dram-bytes" } else { "0." })),
                other => panic!("{ask}: {other:?}"),
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// docs/configuration.md carries the reference generated from the declarations; this fails
    /// when a setting changed and the file did not (UPDATE_CONFIG_REFERENCE=1 rewrites it).
    #[test]
    fn the_configuration_reference_is_current() {
        const BEGIN: &str = "<!-- BEGIN GENERATED SETTINGS REFERENCE -->\n";
        const END: &str = "<!-- END GENERATED SETTINGS REFERENCE -->";
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/configuration.md");
        let text = std::fs::read_to_string(&path).expect("docs/configuration.md");
        let (head, rest) = text.split_once(BEGIN).expect("the BEGIN marker");
        let (current, tail) = rest.split_once(END).expect("the END marker");
        let generated = configuration_reference();
        if std::env::var_os("UPDATE_CONFIG_REFERENCE").is_some() {
            std::fs::write(&path, format!("{head}{BEGIN}{generated}{END}{tail}")).expect("write");
            return;
        }
        assert!(
            current == generated,
            "docs/configuration.md is stale: run UPDATE_CONFIG_REFERENCE=1 cargo test -p kvtide-remote --lib \
             the_configuration_reference_is_current"
        );
        for (group, fields) in OwnerSettings::default().groups() {
            for f in fields {
                assert!(current.contains(&settings::variable_name(group, f.name)), "[{group}] {}", f.name);
            }
        }
    }

    #[test]
    fn the_owner_engine_sees_kvtide_ssd_bytes_and_every_engine_variable() {
        let dir = temp_dir("ssd-bytes");
        let env = vars(&[
            ("KVTIDE_SSD_BYTES", "3GiB"),
            ("KVTIDE_SSD_WRITE_THROUGH", "true"),
            ("KVTIDE_RUNTIME_IDLE_SPIN_US", "7"),
        ]);
        let s =
            OwnerSettings::layered(&env, Some(&in_dir(&dir, "tcp = \"off\"\n")), &Flags::default()).expect("settings");
        let r = s.resolve(&env).expect("resolve");
        assert_eq!(r.store.ssd.bytes, 3 << 30, "KVTIDE_SSD_BYTES, not a default");
        assert_eq!(r.store.ssd.dir, Some(dir.join("ssd")));
        assert!(r.store.ssd.write_through);
        assert_eq!(r.store.runtime.idle_spin_us, 7);
        // A flag beats the variable.
        let s = OwnerSettings::layered(&env, Some(&in_dir(&dir, "tcp = \"off\"\n")), &flags(&["--ssd-bytes", "2GiB"]))
            .expect("settings");
        assert_eq!(s.resolve(&env).expect("resolve").store.ssd.bytes, 2 << 30);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn unknown_owner_names_fail_with_the_closest_valid_one() {
        let e = OwnerSettings::layered(&vars(&[("KVTIDE_OWNER_TCPP", "off")]), None, &Flags::default())
            .expect_err("unknown");
        assert_eq!(e, "unknown variable KVTIDE_OWNER_TCPP; did you mean KVTIDE_OWNER_TCP?");
        let e = OwnerSettings::layered(&vars(&[("KVTIDE_WRITE_THROUGH", "1")]), None, &Flags::default())
            .expect_err("unknown");
        assert!(e.ends_with("did you mean KVTIDE_SSD_WRITE_THROUGH?"), "{e}");
        let e = OwnerSettings::layered(&[], Some("[owner]\nmax_conections = 3\n"), &Flags::default())
            .expect_err("unknown key");
        assert!(e.contains("did you mean max_connections?"), "{e}");
        // The file format before sections: a top-level key names its section.
        let e = OwnerSettings::layered(&[], Some("tcp = \"off\"\n"), &Flags::default()).expect_err("no section");
        assert!(e.contains("did you mean [owner] tcp?"), "{e}");
        let ok = vars(&[("KVTIDE_LOG", "debug"), ("KVTIDE_DATA_DIR", "/x"), ("KVTIDE_TOKEN_FILE", "/t")]);
        OwnerSettings::layered(&ok, None, &Flags::default()).expect("non-setting variables are ignored");
    }
}
