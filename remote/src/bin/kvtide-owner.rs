//! `kvtide-owner`: runs a kvtide engine and serves it to other processes (Unix socket with the
//! DRAM arena shared read-only) and other hosts (TCP, token-authenticated).
//!
//! With no flags it starts a usable owner: a DRAM pool sized from available memory (capped), an
//! SSD tier in the data directory, a Unix socket there (0600 unless `socket_mode` says
//! otherwise), TCP on 127.0.0.1:7370 with a generated token, HTTP (`/metrics`, `/health`,
//! `/ready`, `/version`, `POST /drain`) on 127.0.0.1:7371. Flags and a TOML file override
//! everything (`--help`). SIGINT/SIGTERM stop it cleanly within `stop_budget_ms`: `/ready`
//! turns 503, in-flight requests finish, new ones get `ShuttingDown`, then the engine writes
//! DRAM-only objects to SSD and shuts down. SIGHUP re-reads the settings.

use std::sync::Arc;
use std::time::Instant;

use kvtide::Store;
use kvtide_remote::cluster::{ClusterConfig, EtcdConfig, Member, Registration};
use kvtide_remote::{
    ClusterGroup, HttpListen, HttpServer, HttpState, Invocation, Owner, OwnerSettings, RunTimeSettings,
};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some(kvtide_remote::UCX_PLANE_ARG) {
        std::process::exit(kvtide_remote::ucx_plane_main(&args[2..]));
    }
    if args.get(1).map(String::as_str) == Some(kvtide_remote::UCX_PLANE_CONFINED_ARG) {
        std::process::exit(kvtide_remote::ucx_plane_confinement_check(&args[2..]));
    }
    if let Err(e) = run() {
        // Printed once, on stderr (the log goes there too, so it is not logged as well).
        eprintln!("kvtide-owner: {e}");
        std::process::exit(1);
    }
}

/// Logs to stderr, filtered by `KVTIDE_LOG`, else `RUST_LOG`, else "info"; JSON lines when asked.
fn init_logging(json: bool) {
    let filter = std::env::var("KVTIDE_LOG").or_else(|_| std::env::var("RUST_LOG")).unwrap_or_else(|_| "info".into());
    let filter = tracing_subscriber::EnvFilter::try_new(&filter).unwrap_or_else(|_| "info".into());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).init();
    }
}

fn run() -> Result<(), String> {
    let vars: Vec<(String, String)> = std::env::vars().collect();
    if std::env::args().nth(1).as_deref() == Some("status") {
        init_logging(false);
        return status(std::env::args().nth(2), &vars);
    }
    if std::env::args().nth(1).as_deref() == Some("cluster") {
        init_logging(false);
        return match std::env::args().nth(2).as_deref() {
            Some("status") => cluster_status(std::env::args().skip(3), &vars),
            _ => {
                Err("usage: kvtide-owner cluster status [--cluster etcd://HOST:PORT] [--cluster-name NAME] [--json]"
                    .into())
            }
        };
    }
    let (settings, flags) = match OwnerSettings::load(std::env::args().skip(1), &vars)? {
        Invocation::Serve { settings, flags } => (settings, flags),
        Invocation::Print(text) => {
            print!("{text}");
            return Ok(());
        }
    };
    init_logging(flags.log_json);
    // Each connection holds a descriptor: the usual soft limit of 1024 would cap connections far
    // below the `max_connections` a busy host needs.
    if let Err(e) = kvtide_remote::raise_descriptor_limit() {
        tracing::warn!(error = %e, "could not raise the open-descriptor limit");
    }
    let resolved = settings.resolve(&vars)?;
    if flags.print_config {
        print!("{}", settings.effective_config(&resolved));
        return Ok(());
    }

    // Block the stop signals in every thread (shards and connections inherit the mask), and
    // take them synchronously on one thread below.
    let signals = stop_signals();
    // SAFETY: pthread_sigmask only changes this thread's mask, from a valid set.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &signals, std::ptr::null_mut()) };

    // HTTP first: `/health` answers and `/ready` says "starting" while the store recovers.
    let http = start_http(resolved.http)?;
    // Same-host clients that map the arena read DRAM-resident objects through the read index.
    let store = resolved.store.clone().read_index(resolved.owner.share_arena && resolved.owner.unix_socket.is_some());
    let engine = Arc::new(store.open().map_err(|e| format!("cannot open the store: {e}"))?);
    let stats = engine.stats();
    tracing::info!(
        data_dir = %resolved.data_dir.display(),
        dram_bytes = stats.total.capacity_bytes,
        shards = engine.shard_count(),
        arena = %stats.arena_backing,
        ssd_dir = ?resolved.store.ssd.dir,
        ssd_bytes = resolved.store.ssd.dir.as_ref().map(|_| resolved.store.ssd.bytes),
        max_value_bytes = engine.max_value_bytes(),
        "store open"
    );
    if let Some((path, created)) = &resolved.token_file {
        tracing::info!(
            token_file = %path.display(),
            created,
            "TCP clients authenticate with this token (KVTIDE_TOKEN_FILE=<copy of it> for RemoteStore::connect)"
        );
    }
    let (socket_mode, socket_group) = (resolved.owner.unix_socket_mode, resolved.owner.unix_socket_group);
    let max_connections = resolved.owner.max_connections;
    let owner = Arc::new(Owner::start(Arc::clone(&engine), resolved.owner).map_err(|e| e.to_string())?);
    if let Some(path) = owner.unix_path() {
        let mode = format!("{socket_mode:04o}");
        tracing::info!(socket = %path.display(), mode, group = ?socket_group, max_connections, "listening (Unix socket)");
    }
    if let Some(addr) = owner.tcp_addr() {
        tracing::info!(%addr, "listening (TCP)");
    }
    let registration = match settings.cluster.etcd_config()? {
        Some(etcd) => {
            let registration = join_cluster(&settings.cluster, etcd, &owner, &engine)?;
            let m = registration.member();
            tracing::info!(cluster = %settings.cluster.name, id = %m.id, advertise = %m.tcp, "registered in the cluster");
            Some(registration)
        }
        None => None,
    };
    if let Some(http) = &http {
        http.state().serving(Arc::clone(&owner));
    }
    notify_supervisor("READY=1\nSTATUS=serving");

    let mut running = *settings;
    let signal = wait_for_stop(&signals, || reload_settings(&mut running, &vars, &owner))?;
    let signalled = Instant::now();
    if let Some(http) = &http {
        http.state().stopping();
    }
    tracing::info!(signal, "stopping: finishing in-flight requests");
    notify_supervisor("STOPPING=1\nSTATUS=stopping: finishing in-flight requests");
    exit_on_second_signal(signals);
    // Leave the cluster first: clients stop routing here before requests are refused.
    if let Some(registration) = registration {
        registration.shutdown();
    }
    let report = owner.stop_within_budget(signalled);
    drop(owner);
    // Last: `/health` answers (and `/ready` says "stopping") until the engine has shut down.
    drop(http);
    tracing::info!(
        stop_ms = report.stopped.as_millis() as u64,
        budget_ms = running.owner.stop_budget_ms,
        grace_ms = report.plan.grace.as_millis() as u64,
        drained_ms = report.drained.as_millis() as u64,
        flushed_objects = report.flushed_objects,
        unflushed_objects = report.unflushed_objects,
        unflushed_bytes = report.unflushed_bytes,
        "kvtide owner stopped"
    );
    Ok(())
}

/// Waits for SIGINT or SIGTERM (blocked in every thread, taken here synchronously) and returns
/// it; each SIGHUP meanwhile calls `on_hangup` and waits on.
fn wait_for_stop(signals: &libc::sigset_t, mut on_hangup: impl FnMut()) -> Result<libc::c_int, String> {
    loop {
        let mut signal: libc::c_int = 0;
        // SAFETY: sigwait reads the set and writes the received signal number into `signal`.
        let rc = unsafe { libc::sigwait(signals, &mut signal) };
        if rc != 0 {
            return Err(format!("sigwait failed: {}", std::io::Error::from_raw_os_error(rc)));
        }
        if signal != libc::SIGHUP {
            return Ok(signal);
        }
        on_hangup();
    }
}

/// While the stop runs: a second SIGINT or SIGTERM ends the process at once; SIGHUP is ignored.
fn exit_on_second_signal(signals: libc::sigset_t) {
    std::thread::spawn(move || {
        let again = wait_for_stop(&signals, || tracing::info!("SIGHUP ignored: the owner is stopping"));
        if again.is_ok() {
            eprintln!("kvtide-owner: second signal, exiting now");
            std::process::exit(130);
        }
    });
}

/// SIGHUP: re-reads the settings (the flags, the `--config` file, the variables the owner
/// started with), applies those that change at run time (`RunTimeSettings::NAMES`) and logs by
/// name those that changed but take a restart. Logs go to stderr only, so there is no log file
/// to reopen. A file that no longer reads keeps everything as it was.
fn reload_settings(running: &mut OwnerSettings, vars: &[(String, String)], owner: &Owner) {
    let fresh = match OwnerSettings::load(std::env::args().skip(1), vars) {
        Ok(Invocation::Serve { settings, .. }) => settings,
        Ok(Invocation::Print(_)) => return,
        Err(e) => {
            tracing::warn!(error = %e, "SIGHUP: cannot re-read the settings; nothing changed");
            return;
        }
    };
    let changed = running.changed_settings(&fresh);
    let named = |list: &[(&str, &str)]| list.iter().map(|(g, f)| format!("[{g}] {f}")).collect::<Vec<_>>().join(", ");
    let (now, later): (Vec<_>, Vec<_>) =
        changed.into_iter().partition(|(g, f)| *g == "owner" && RunTimeSettings::NAMES.contains(f));
    if !later.is_empty() {
        tracing::warn!(settings = %named(&later), "SIGHUP: changed settings that take a restart (not applied)");
    }
    if now.is_empty() {
        tracing::info!("SIGHUP: settings re-read; no run-time setting changed (logs go to stderr: nothing to reopen)");
        return;
    }
    let o = &fresh.owner;
    let wanted = RunTimeSettings {
        idle_timeout_ms: o.idle_timeout_ms,
        shutdown_grace_ms: o.shutdown_grace_ms,
        stop_budget_ms: o.stop_budget_ms,
    };
    match owner.apply_run_time_settings(wanted) {
        Ok(()) => {
            running.owner.idle_timeout_ms = wanted.idle_timeout_ms;
            running.owner.shutdown_grace_ms = wanted.shutdown_grace_ms;
            running.owner.stop_budget_ms = wanted.stop_budget_ms;
            tracing::info!(settings = %named(&now), ?wanted, "SIGHUP: applied");
        }
        Err(e) => tracing::warn!(error = %e, "SIGHUP: run-time settings refused; nothing changed"),
    }
}

/// Starts the HTTP listener, if one is configured. The default address taken (another owner on
/// this host) only turns HTTP off, with a warning; an address the operator chose must bind.
fn start_http(listen: Option<HttpListen>) -> Result<Option<HttpServer>, String> {
    let Some(HttpListen { addr, chosen }) = listen else { return Ok(None) };
    match HttpServer::start(addr, HttpState::new()) {
        Ok(server) => {
            // Tests and tools read the bound address (port 0 asks for any) from this line.
            tracing::info!(http_addr = %server.addr(), "HTTP listening: GET /metrics /health /ready /version, POST /drain");
            Ok(Some(server))
        }
        Err(e) if !chosen && e.kind() == std::io::ErrorKind::AddrInUse => {
            tracing::warn!(
                %addr,
                "the default HTTP address is taken (another owner on this host?): running without HTTP; \
                 set --http-addr (or [owner] http_addr) to serve it elsewhere, \"off\" to silence this"
            );
            Ok(None)
        }
        Err(e) => Err(format!("cannot listen for HTTP on {addr} ([owner] http_addr): {e}")),
    }
}

/// `kvtide-owner status [ADDRESS]`: asks a running owner (default: the default data directory's
/// socket) for its health; exit status 0 when it serves, 1 when it cannot be reached.
fn status(address: Option<String>, vars: &[(String, String)]) -> Result<(), String> {
    let address = address.unwrap_or_else(|| format!("unix:{}", kvtide_remote::default_socket(vars).display()));
    let options = kvtide_remote::ClientOptions {
        shared_memory: false,
        ..kvtide_remote::ClientOptions::from_env().map_err(|e| e.to_string())?
    };
    let store = kvtide_remote::RemoteStore::connect_with(&address, options)
        .map_err(|e| format!("no owner serving at {address}: {e}"))?;
    let stats = store.try_stats().map_err(|e| format!("the owner at {address} did not answer: {e}"))?;
    let t = &stats.total;
    println!("kvtide-owner at {address}: serving");
    println!("shards {}  objects {}  (on SSD {})", stats.shards.len(), t.objects, t.ssd_objects);
    println!("DRAM used {} of {} bytes  SSD {} bytes", t.bytes_used, t.capacity_bytes, t.ssd_bytes);
    println!(
        "hits {}  misses {}  evictions {}  leases held {} (and {} through the published index)",
        t.hits, t.misses, t.evictions, t.leases_held, t.published_leases_held
    );
    if t.ssd_write_failed > 0 {
        println!("SSD tier: writes stopped after an I/O error (ssd_write_failed)");
    }
    Ok(())
}

/// Registers this owner in its cluster (`[cluster]`), advertising its TCP address.
fn join_cluster(
    group: &ClusterGroup,
    etcd: EtcdConfig,
    owner: &Owner,
    engine: &Arc<kvtide::Engine>,
) -> Result<Registration, String> {
    let advertise = match (&group.advertise, owner.tcp_addr()) {
        (_, None) => return Err("a cluster owner serves TCP (other hosts connect to it): set --tcp".into()),
        (Some(a), Some(_)) => a.clone(),
        (None, Some(addr)) if addr.ip().is_unspecified() => {
            return Err(format!("the owner listens on {addr} (every interface): give --advertise HOST:PORT"))
        }
        (None, Some(addr)) => addr.to_string(),
    };
    let config = ClusterConfig {
        etcd,
        name: group.name.clone(),
        id: group.id.clone().unwrap_or_else(|| advertise.clone()),
        advertise,
        lease_ttl_s: group.lease_ttl_s,
    };
    let stats = engine.stats();
    let member = Member {
        id: config.id.clone(),
        tcp: config.advertise.clone(),
        unix_socket: owner.unix_path().map(|p| p.display().to_string()),
        host: kvtide_remote::cluster::member::host_identity(),
        generation: 0,
        capacity_bytes: stats.total.capacity_bytes,
        used_bytes: 0,
        objects: 0,
        ssd_bytes: 0,
    };
    let engine = Arc::clone(engine);
    let usage = Box::new(move || {
        let t = engine.stats().total;
        (t.bytes_used, t.objects, t.ssd_bytes)
    });
    Registration::start(&config, member, usage, Arc::clone(&owner.counters().cluster))
        .map_err(|e| format!("cannot join cluster {:?}: {e}", config.name))
}

/// `kvtide-owner cluster status`: the members of a cluster as etcd lists them, with their
/// capacity and use, and entries that are not valid members. Exit status 1 when etcd cannot be
/// read.
fn cluster_status(args: impl Iterator<Item = String>, vars: &[(String, String)]) -> Result<(), String> {
    let args: Vec<String> = args.collect();
    let json = args.iter().any(|a| a == "--json");
    let rest = args.into_iter().filter(|a| a != "--json");
    let settings = match OwnerSettings::load(rest, vars)? {
        Invocation::Serve { settings, .. } => settings,
        Invocation::Print(text) => {
            print!("{text}");
            return Ok(());
        }
    };
    let Some(etcd) = settings.cluster.etcd_config()? else {
        return Err("give the cluster's etcd: --cluster etcd://HOST:PORT (or KVTIDE_CLUSTER_ETCD)".into());
    };
    let name = &settings.cluster.name;
    let client = kvtide_remote::cluster::Etcd::new(etcd).map_err(|e| e.to_string())?;
    let prefix = kvtide_remote::cluster::member::members_prefix(name);
    let entries = client.get_prefix(prefix.as_bytes()).map_err(|e| e.to_string())?;
    let mut members = Vec::new();
    let mut invalid = Vec::new();
    for kv in entries {
        match kvtide_remote::cluster::member::parse_member(&prefix, &kv.key, &kv.value) {
            Ok(m) => members.push(m),
            Err(why) => invalid.push((String::from_utf8_lossy(&kv.key).into_owned(), why)),
        }
    }
    if json {
        let invalid: Vec<_> = invalid.iter().map(|(k, why)| serde_json::json!({ "key": k, "error": why })).collect();
        let out = serde_json::json!({ "cluster": name, "members": members, "invalid": invalid });
        println!("{out}");
        return Ok(());
    }
    println!("cluster {name:?}: {} member(s)", members.len());
    if !members.is_empty() {
        println!(
            "{:<24} {:<22} {:>14} {:>14} {:>10} {:>14}  unix socket",
            "id", "address", "capacity", "DRAM used", "objects", "SSD used"
        );
    }
    for m in &members {
        println!(
            "{:<24} {:<22} {:>14} {:>14} {:>10} {:>14}  {}",
            m.id,
            m.tcp,
            m.capacity_bytes,
            m.used_bytes,
            m.objects,
            m.ssd_bytes,
            m.unix_socket.as_deref().unwrap_or("-")
        );
    }
    for (key, why) in &invalid {
        println!("invalid entry {key}: {why}");
    }
    Ok(())
}

/// Tells a supervisor (systemd `Type=notify`) about a state change, when `NOTIFY_SOCKET` names
/// one (a path, or `@name` for an abstract socket). Best effort: a supervisor that is gone
/// must not stop the owner.
fn notify_supervisor(state: &str) {
    let Some(target) = std::env::var_os("NOTIFY_SOCKET") else { return };
    let Ok(socket) = std::os::unix::net::UnixDatagram::unbound() else { return };
    let bytes = target.as_encoded_bytes();
    let sent = if let Some(name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(name)
            .and_then(|addr| socket.send_to_addr(state.as_bytes(), &addr))
    } else {
        socket.send_to(state.as_bytes(), std::path::Path::new(&target))
    };
    if let Err(e) = sent {
        tracing::warn!(error = %e, "could not notify the supervisor (NOTIFY_SOCKET)");
    }
}

/// SIGINT and SIGTERM (stop) and SIGHUP (re-read the settings).
fn stop_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it before sigaddset adds to it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGHUP);
        set
    }
}
