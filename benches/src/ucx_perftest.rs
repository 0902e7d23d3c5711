//! The raw UCX baseline of `remote --transport ucx`: `ucx_perftest -t ucp_get -O 8`, one server
//! and one client process per kvtide client, all at once, over the same UCX transports and sizes.
//!
//! Owns starting the pairs and reading their `Final:` lines. Never measures kvtide.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::hist::Histogram;
use crate::remote::{Phase, RemoteArgs, Row};

/// Gets in flight per client: ucx_perftest's best (with one, each get takes about 1 ms over
/// tcp whatever its size; with 8 or more the rate stops growing).
const OUTSTANDING: u32 = 8;

/// The baseline's name in the tables.
pub(crate) const SYSTEM: &str = "ucx_perftest ucp_get";

struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Gets of `size` bytes by `clients` pairs for about `duration` (iterations sized from
/// `kvtide_ops_per_sec`, kvtide's rate in the same cell): the pairs' message rates summed, and
/// the first pair's median latency as the histogram's one sample.
pub(crate) fn get_row(
    args: &RemoteArgs,
    size: u64,
    clients: usize,
    kvtide_ops_per_sec: f64,
    duration: Duration,
) -> Result<Row, String> {
    let per_client = kvtide_ops_per_sec / clients as f64;
    let iters = ((per_client * duration.as_secs_f64()) as u64).clamp(20, 1_000_000);
    let warmup = (iters / 10).max(5);
    let command = |port: u16| {
        let mut c = Command::new(&args.ucx_perftest);
        c.env("UCX_TLS", &args.ucx_tls).args(["-p", &port.to_string()]).stdin(Stdio::null());
        // The settings kvtide's plane serves with for this bench's owner on loopback (lo only
        // over tcp alone, its tcp segment size): the best this baseline does here too.
        if let Ok(transports) = kvtide_remote::UcxTransports::parse(&args.ucx_tls, true) {
            c.envs(transports.serving_env(true));
        }
        c
    };
    let mut servers = Vec::with_capacity(clients);
    let mut ports = Vec::with_capacity(clients);
    for _ in 0..clients {
        let port = TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| e.to_string())?.port();
        let server = command(port).stdout(Stdio::null()).stderr(Stdio::null()).spawn().map_err(|e| {
            format!("cannot start {} ({e}); install it with `apt-get install -y ucx-utils`", args.ucx_perftest)
        })?;
        servers.push(Reaped(server));
        ports.push(port);
    }
    // The servers listen once they started; a client that comes too early retries below.
    std::thread::sleep(Duration::from_millis(300));
    let outputs: Vec<Result<String, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = ports
            .iter()
            .map(|&port| {
                scope.spawn(move || {
                    for _ in 0..20 {
                        let out = command(port)
                            .args(["-t", "ucp_get", "-s", &size.to_string(), "-n", &iters.to_string()])
                            .args(["-w", &warmup.to_string(), "-O", &OUTSTANDING.to_string(), "127.0.0.1"])
                            .output()
                            .map_err(|e| e.to_string())?;
                        let text = String::from_utf8_lossy(&out.stdout).into_owned();
                        if out.status.success() && text.contains("Final:") {
                            return Ok(text);
                        }
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    Err(format!("{} did not finish a ucp_get run on port {port}", "ucx_perftest"))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("thread panicked".into()))).collect()
    });
    drop(servers);
    let mut get = Phase { secs: 1.0, ..Phase::default() };
    let mut hist = Histogram::default();
    for out in outputs {
        let (p50_us, rate) = parse_final(&out?)?;
        if hist.count() == 0 {
            hist.record((p50_us * 1000.0) as u64);
        }
        get.ops += rate as u64;
        get.bytes += (rate * size as f64) as u64;
    }
    get.hist = hist;
    Ok(Row { size, clients, system: SYSTEM, put: None, get })
}

/// (median latency in µs, overall message rate per second) of a `Final:` line.
fn parse_final(text: &str) -> Result<(f64, f64), String> {
    let line = text.lines().find(|l| l.trim_start().starts_with("Final:")).ok_or("no Final: line")?;
    let fields: Vec<f64> = line.split_whitespace().skip(1).filter_map(|f| f.replace(',', "").parse().ok()).collect();
    match fields.as_slice() {
        [_, p50, _, _, _, _, _, rate, ..] => Ok((*p50, *rate)),
        _ => Err(format!("unexpected ucx_perftest output: {line}")),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_the_final_line() {
        let text = "Final:                  2000   1476.216  1482.872  1471.684      674.37     679.49         674         679\n";
        assert_eq!(super::parse_final(text), Ok((1476.216, 679.0)));
        assert!(super::parse_final("nothing").is_err());
    }
}
