//! etcd through its JSON gateway (`POST /v3/...` on the client port, served by etcd 3.4 and
//! later). Owns the HTTP calls, failover across endpoints, authentication tokens, TLS settings
//! and the decoding of etcd's answers; never decides what the keys mean (members are
//! `member.rs`). Blocking calls with a deadline each, so a dead etcd costs a bounded wait.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde_json::{json, Value};

/// Largest etcd answer read (a membership list of thousands of owners fits many times over).
const MAX_RESPONSE_BYTES: u64 = 16 << 20;
/// Keys one range reads at most.
const MAX_RANGE_KEYS: u64 = 10_000;
/// gRPC status etcd answers when a token expired or is missing.
const UNAUTHENTICATED: i64 = 16;
/// gRPC status of "requested lease not found".
const NOT_FOUND: i64 = 5;

/// Where etcd is and how to talk to it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EtcdConfig {
    /// Base URLs (`http://HOST:PORT` or `https://HOST:PORT`), tried in order on failure.
    pub endpoints: Vec<String>,
    /// User name and password (etcd's auth), when etcd requires them.
    pub user: Option<(String, String)>,
    /// CA certificate (PEM) that signed etcd's server certificate (`https` endpoints).
    pub ca_file: Option<PathBuf>,
    /// Client certificate and key (PEM) when etcd requires client certificates.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// Deadline of one call to one endpoint.
    pub timeout_ms: u64,
}

/// Deadline of one etcd call unless set.
pub const DEFAULT_ETCD_TIMEOUT_MS: u64 = 2000;

impl EtcdConfig {
    /// Parses `etcd://HOST:PORT[,HOST:PORT...]` (plain HTTP), `etcds://...` (HTTPS), or a comma
    /// list of `http://` / `https://` URLs.
    pub fn parse(spec: &str) -> Result<EtcdConfig, EtcdError> {
        let invalid = |reason: &str| EtcdError::InvalidEndpoints { spec: spec.to_string(), reason: reason.to_string() };
        let (scheme, rest) = if let Some(rest) = spec.strip_prefix("etcd://") {
            ("http", rest)
        } else if let Some(rest) = spec.strip_prefix("etcds://") {
            ("https", rest)
        } else if spec.starts_with("http://") || spec.starts_with("https://") {
            ("", spec)
        } else {
            return Err(invalid("expected etcd://HOST:PORT[,HOST:PORT...] (or etcds:// for TLS)"));
        };
        let mut endpoints = Vec::new();
        for part in rest.split(',') {
            let part = part.trim();
            let url = if scheme.is_empty() { part.to_string() } else { format!("{scheme}://{part}") };
            let hostport = url.split_once("://").map(|(_, h)| h).unwrap_or("").trim_end_matches('/');
            let Some((host, port)) = hostport.rsplit_once(':') else {
                return Err(invalid(&format!("endpoint {part:?} has no :PORT")));
            };
            if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) || hostport.contains('/') {
                return Err(invalid(&format!("endpoint {part:?} is not HOST:PORT")));
            }
            endpoints.push(url.trim_end_matches('/').to_string());
        }
        if endpoints.is_empty() || endpoints.len() > 64 {
            return Err(invalid("give 1 to 64 endpoints"));
        }
        Ok(EtcdConfig { endpoints, timeout_ms: DEFAULT_ETCD_TIMEOUT_MS, ..EtcdConfig::default() })
    }
}

/// What went wrong talking to etcd.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EtcdError {
    #[error("invalid etcd endpoints {spec:?}: {reason}")]
    InvalidEndpoints { spec: String, reason: String },
    #[error("etcd is unreachable at {endpoints}: {reason}")]
    Unreachable { endpoints: String, reason: String },
    #[error("etcd refused {op}: {message}")]
    Refused { op: &'static str, message: String, code: i64 },
    #[error("etcd answered {op} with something unexpected: {detail}")]
    Malformed { op: &'static str, detail: String },
    #[error("etcd TLS settings: {0}")]
    Tls(String),
}

/// One key of a range answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub lease: i64,
}

/// A blocking etcd client.
pub struct Etcd {
    config: EtcdConfig,
    agent: ureq::Agent,
    /// The endpoint that answered last; calls start there.
    current: AtomicUsize,
    token: Mutex<Option<String>>,
}

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Etcd").field("endpoints", &self.config.endpoints).finish()
    }
}

impl Etcd {
    /// A client for `config` (nothing is contacted yet).
    pub fn new(config: EtcdConfig) -> Result<Etcd, EtcdError> {
        let timeout = Duration::from_millis(config.timeout_ms.max(1));
        let mut builder = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(timeout))
            .timeout_connect(Some(timeout))
            .max_redirects(0);
        if config.ca_file.is_some() || config.cert_file.is_some() {
            builder = builder.tls_config(tls_config(&config)?);
        }
        Ok(Etcd { agent: builder.build().into(), config, current: AtomicUsize::new(0), token: Mutex::new(None) })
    }

    /// The endpoints, for messages.
    pub fn endpoints(&self) -> String {
        self.config.endpoints.join(",")
    }

    /// Grants a lease of `ttl_s` seconds; returns its id and the TTL etcd granted.
    pub fn grant(&self, ttl_s: u64) -> Result<(i64, i64), EtcdError> {
        let answer = self.call("lease grant", "/v3/lease/grant", json!({ "TTL": ttl_s }))?;
        let id = int(&answer, "ID");
        if id == 0 {
            return Err(EtcdError::Malformed { op: "lease grant", detail: answer.to_string() });
        }
        Ok((id, int(&answer, "TTL")))
    }

    /// Renews lease `id`; None when it no longer exists (it expired or was revoked).
    pub fn keep_alive(&self, id: i64) -> Result<Option<i64>, EtcdError> {
        let answer = self.call("lease keep-alive", "/v3/lease/keepalive", json!({ "ID": id.to_string() }))?;
        // The gateway wraps stream messages in "result"; a TTL of 0 (absent) means gone.
        let ttl = answer.get("result").map_or(0, |r| int(r, "TTL"));
        Ok((ttl > 0).then_some(ttl))
    }

    /// Revokes lease `id`, deleting its keys at once. A lease already gone is not an error.
    pub fn revoke(&self, id: i64) -> Result<(), EtcdError> {
        match self.call("lease revoke", "/v3/lease/revoke", json!({ "ID": id.to_string() })) {
            Err(EtcdError::Refused { code: NOT_FOUND, .. }) | Ok(_) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Writes `key` (attached to `lease`, unless 0).
    pub fn put(&self, key: &[u8], value: &[u8], lease: i64) -> Result<(), EtcdError> {
        self.call(
            "put",
            "/v3/kv/put",
            json!({ "key": B64.encode(key), "value": B64.encode(value), "lease": lease.to_string() }),
        )
        .map(drop)
    }

    /// Writes `key` only if it does not exist; false when it does.
    pub fn create(&self, key: &[u8], value: &[u8], lease: i64) -> Result<bool, EtcdError> {
        let key = B64.encode(key);
        let answer = self.call(
            "create",
            "/v3/kv/txn",
            json!({
                "compare": [{ "key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0" }],
                "success": [{ "request_put": { "key": key, "value": B64.encode(value), "lease": lease.to_string() } }],
            }),
        )?;
        Ok(answer.get("succeeded").and_then(Value::as_bool).unwrap_or(false))
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &[u8]) -> Result<Option<KeyValue>, EtcdError> {
        let answer = self.call("get", "/v3/kv/range", json!({ "key": B64.encode(key) }))?;
        Ok(key_values("get", &answer)?.into_iter().next())
    }

    /// Every key starting with `prefix` (at most `MAX_RANGE_KEYS`).
    pub fn get_prefix(&self, prefix: &[u8]) -> Result<Vec<KeyValue>, EtcdError> {
        let answer = self.call(
            "range",
            "/v3/kv/range",
            json!({ "key": B64.encode(prefix), "range_end": B64.encode(prefix_end(prefix)), "limit": MAX_RANGE_KEYS }),
        )?;
        key_values("range", &answer)
    }

    /// Deletes `key` (absent is not an error).
    pub fn delete(&self, key: &[u8]) -> Result<(), EtcdError> {
        self.call("delete", "/v3/kv/deleterange", json!({ "key": B64.encode(key) })).map(drop)
    }

    /// One call, on each endpoint in turn from the last that answered, authenticating (again)
    /// when etcd asks for it.
    fn call(&self, op: &'static str, path: &str, body: Value) -> Result<Value, EtcdError> {
        let mut authenticated_again = false;
        loop {
            match self.call_once(op, path, &body) {
                Err(EtcdError::Refused { code: UNAUTHENTICATED, .. })
                    if self.config.user.is_some() && !authenticated_again =>
                {
                    authenticated_again = true;
                    self.authenticate()?;
                }
                other => return other,
            }
        }
    }

    fn call_once(&self, op: &'static str, path: &str, body: &Value) -> Result<Value, EtcdError> {
        if self.config.user.is_some() && self.token.lock().unwrap_or_else(|p| p.into_inner()).is_none() {
            self.authenticate()?;
        }
        let token = self.token.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let n = self.config.endpoints.len();
        let start = self.current.load(Ordering::Relaxed);
        let mut failures = Vec::new();
        for i in 0..n {
            let index = (start + i) % n;
            let endpoint = &self.config.endpoints[index];
            match self.post(endpoint, path, body, token.as_deref()) {
                Ok((status, answer)) => {
                    self.current.store(index, Ordering::Relaxed);
                    if status == 200 {
                        return Ok(answer);
                    }
                    let message = answer
                        .get("message")
                        .or_else(|| answer.get("error"))
                        .and_then(Value::as_str)
                        .map_or_else(|| format!("HTTP {status}: {answer}"), str::to_string);
                    return Err(EtcdError::Refused { op, message, code: int(&answer, "code") });
                }
                Err(reason) => failures.push(format!("{endpoint}: {reason}")),
            }
        }
        Err(EtcdError::Unreachable { endpoints: self.endpoints(), reason: failures.join("; ") })
    }

    fn post(&self, endpoint: &str, path: &str, body: &Value, token: Option<&str>) -> Result<(u16, Value), String> {
        let mut request = self.agent.post(format!("{endpoint}{path}")).content_type("application/json");
        if let Some(token) = token {
            request = request.header("Authorization", token);
        }
        let mut response = request.send(body.to_string().as_bytes()).map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let bytes =
            response.body_mut().with_config().limit(MAX_RESPONSE_BYTES).read_to_vec().map_err(|e| e.to_string())?;
        let answer: Value = serde_json::from_slice(&bytes)
            .map_err(|e| format!("not an etcd JSON answer (HTTP {status}): {e}; is this etcd's client port?"))?;
        Ok((status, answer))
    }

    fn authenticate(&self) -> Result<(), EtcdError> {
        let Some((name, password)) = &self.config.user else { return Ok(()) };
        let n = self.config.endpoints.len();
        let mut failures = Vec::new();
        for endpoint in &self.config.endpoints[..n] {
            match self.post(endpoint, "/v3/auth/authenticate", &json!({ "name": name, "password": password }), None) {
                Ok((200, answer)) => {
                    let token = answer
                        .get("token")
                        .and_then(Value::as_str)
                        .ok_or_else(|| EtcdError::Malformed { op: "authenticate", detail: answer.to_string() })?;
                    *self.token.lock().unwrap_or_else(|p| p.into_inner()) = Some(token.to_string());
                    return Ok(());
                }
                Ok((status, answer)) => {
                    let message = answer.get("message").and_then(Value::as_str).unwrap_or("").to_string();
                    return Err(EtcdError::Refused {
                        op: "authenticate",
                        message: format!("HTTP {status}: {message}"),
                        code: int(&answer, "code"),
                    });
                }
                Err(reason) => failures.push(format!("{endpoint}: {reason}")),
            }
        }
        Err(EtcdError::Unreachable { endpoints: self.endpoints(), reason: failures.join("; ") })
    }
}

fn tls_config(config: &EtcdConfig) -> Result<ureq::tls::TlsConfig, EtcdError> {
    use ureq::tls::{Certificate, ClientCert, PemItem, PrivateKey, RootCerts, TlsConfig};
    let read = |path: &PathBuf| std::fs::read(path).map_err(|e| EtcdError::Tls(format!("{}: {e}", path.display())));
    let mut builder = TlsConfig::builder();
    if let Some(ca) = &config.ca_file {
        let pem = read(ca)?;
        let mut certs: Vec<Certificate<'static>> = Vec::new();
        for item in ureq::tls::parse_pem(&pem) {
            match item.map_err(|e| EtcdError::Tls(format!("{}: {e}", ca.display())))? {
                PemItem::Certificate(c) => certs.push(c),
                _ => continue,
            }
        }
        if certs.is_empty() {
            return Err(EtcdError::Tls(format!("{}: no certificate in it", ca.display())));
        }
        builder = builder.root_certs(RootCerts::new_with_certs(&certs));
    }
    match (&config.cert_file, &config.key_file) {
        (Some(cert), Some(key)) => {
            let cert_pem = read(cert)?;
            let chain: Vec<Certificate<'static>> = ureq::tls::parse_pem(&cert_pem)
                .filter_map(|item| match item {
                    Ok(PemItem::Certificate(c)) => Some(c),
                    _ => None,
                })
                .collect();
            let key =
                PrivateKey::from_pem(&read(key)?).map_err(|e| EtcdError::Tls(format!("{}: {e}", key.display())))?;
            builder = builder.client_cert(Some(ClientCert::new_with_certs(&chain, key)));
        }
        (None, None) => {}
        _ => return Err(EtcdError::Tls("a client certificate needs both cert_file and key_file".into())),
    }
    Ok(builder.build())
}

/// The end of the range of keys starting with `prefix`.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every key: etcd reads "\0" as "to the end".
    vec![0]
}

/// An int64 field: the gateway writes them as strings, and leaves out zeros.
fn int(value: &Value, field: &str) -> i64 {
    match value.get(field) {
        Some(Value::String(s)) => s.parse().unwrap_or(0),
        Some(Value::Number(n)) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

fn key_values(op: &'static str, answer: &Value) -> Result<Vec<KeyValue>, EtcdError> {
    let Some(kvs) = answer.get("kvs") else { return Ok(Vec::new()) };
    let malformed = |detail: String| EtcdError::Malformed { op, detail };
    let list = kvs.as_array().ok_or_else(|| malformed(format!("kvs is not a list: {kvs}")))?;
    let decode = |kv: &Value, field: &str| -> Result<Vec<u8>, EtcdError> {
        match kv.get(field) {
            None => Ok(Vec::new()),
            Some(Value::String(s)) => B64.decode(s).map_err(|e| malformed(format!("{field} is not base64: {e}"))),
            Some(other) => Err(malformed(format!("{field} is not a string: {other}"))),
        }
    };
    list.iter()
        .map(|kv| Ok(KeyValue { key: decode(kv, "key")?, value: decode(kv, "value")?, lease: int(kv, "lease") }))
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_lists_parse_and_bad_ones_say_why() {
        let c = EtcdConfig::parse("etcd://127.0.0.1:2379,10.0.0.2:2379").unwrap();
        assert_eq!(c.endpoints, ["http://127.0.0.1:2379", "http://10.0.0.2:2379"]);
        assert_eq!(EtcdConfig::parse("etcds://h:1").unwrap().endpoints, ["https://h:1"]);
        assert_eq!(EtcdConfig::parse("http://a:1,https://b:2/").unwrap().endpoints, ["http://a:1", "https://b:2"]);
        for bad in [
            "",
            "127.0.0.1:2379",
            "etcd://",
            "etcd://host",
            "etcd://h:0",
            "etcd://h:99999",
            "etcd://h:1/x",
            "etcd://h:1,",
        ] {
            let e = EtcdConfig::parse(bad).unwrap_err();
            assert!(matches!(e, EtcdError::InvalidEndpoints { .. }), "{bad}: {e}");
        }
    }

    #[test]
    fn prefix_ranges_end_after_the_prefix() {
        assert_eq!(prefix_end(b"/a/"), b"/a0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), b"\0");
    }

    #[test]
    fn gateway_answers_decode() {
        let answer = json!({"kvs": [{"key": B64.encode("k"), "value": B64.encode("v"), "lease": "42"}], "count": "1"});
        assert_eq!(
            key_values("range", &answer).unwrap(),
            [KeyValue { key: b"k".to_vec(), value: b"v".to_vec(), lease: 42 }]
        );
        assert!(key_values("range", &json!({"kvs": [{"key": "!!"}]})).is_err());
        assert!(key_values("range", &json!({"kvs": 3})).is_err());
        assert_eq!(key_values("range", &json!({})).unwrap(), []);
        assert_eq!(int(&json!({"TTL": "7"}), "TTL"), 7);
        assert_eq!(int(&json!({"TTL": 7}), "TTL"), 7);
        assert_eq!(int(&json!({}), "TTL"), 0);
    }
}
