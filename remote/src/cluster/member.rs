//! Member records: what an owner writes under `/kvtide/<cluster>/owners/<id>` and clients read
//! back. Owns the record's format, its validation (a garbage entry is reported and skipped, never
//! routed to) and the names of cluster keys; never talks to etcd.

use serde::{Deserialize, Serialize};

/// Largest member record accepted.
pub const MAX_MEMBER_BYTES: usize = 16 << 10;
/// Longest owner id and cluster name.
pub const MAX_ID_BYTES: usize = 128;

/// One owner as the cluster sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Stable identity: placement hashes on it, so an owner that comes back under the same id
    /// (with its SSD tier) serves its keys again.
    pub id: String,
    /// TCP address clients on other hosts connect to (HOST:PORT).
    pub tcp: String,
    /// Unix socket, for clients on the same host (`host` equal to theirs).
    #[serde(default)]
    pub unix_socket: Option<String>,
    /// Which host (and boot) the owner runs on.
    #[serde(default)]
    pub host: String,
    /// When this owner process started (ms since the epoch): a restart is a new generation.
    pub generation: u64,
    #[serde(default)]
    pub capacity_bytes: u64,
    #[serde(default)]
    pub used_bytes: u64,
    #[serde(default)]
    pub objects: u64,
    #[serde(default)]
    pub ssd_bytes: u64,
}

/// The etcd prefix of a cluster's members.
pub fn members_prefix(cluster: &str) -> String {
    format!("/kvtide/{cluster}/owners/")
}

/// Checks a cluster name or owner id: 1 to 128 of `[A-Za-z0-9._:-]`.
pub fn check_name(what: &str, name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_ID_BYTES {
        return Err(format!("{what} must be 1 to {MAX_ID_BYTES} characters, got {} ({name:?})", name.len()));
    }
    if let Some(c) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':'))) {
        return Err(format!("{what} {name:?} contains {c:?}; use letters, digits, '.', '_', '-' and ':'"));
    }
    Ok(())
}

/// Checks `HOST:PORT` (not resolved here).
pub fn check_address(address: &str) -> Result<(), String> {
    let Some((host, port)) = address.rsplit_once(':') else {
        return Err(format!("address {address:?} is not HOST:PORT"));
    };
    if host.is_empty() || host.len() > 255 || port.parse::<u16>().map_or(true, |p| p == 0) {
        return Err(format!("address {address:?} is not HOST:PORT"));
    }
    Ok(())
}

/// Decodes and checks the record stored under `key` (below `prefix`).
pub fn parse_member(prefix: &str, key: &[u8], value: &[u8]) -> Result<Member, String> {
    let id = key.strip_prefix(prefix.as_bytes()).ok_or("key outside the members prefix")?;
    let id = std::str::from_utf8(id).map_err(|_| "the owner id in the key is not UTF-8".to_string())?;
    if value.len() > MAX_MEMBER_BYTES {
        return Err(format!("record of {} bytes (at most {MAX_MEMBER_BYTES})", value.len()));
    }
    let member: Member = serde_json::from_slice(value).map_err(|e| format!("not a member record: {e}"))?;
    check_name("owner id", &member.id)?;
    if member.id != id {
        return Err(format!("record names owner {:?} under the key of {id:?}", member.id));
    }
    check_address(&member.tcp)?;
    if let Some(path) = &member.unix_socket {
        if !path.starts_with('/') || path.len() > 107 {
            return Err(format!("unix socket {path:?} is not an absolute path of at most 107 bytes"));
        }
    }
    Ok(member)
}

/// This host and boot: hostname plus the kernel's boot id. Owners and clients that share it
/// share a machine (and a container's hostname keeps two containers apart).
pub fn host_identity() -> String {
    let read = |path: &str| std::fs::read_to_string(path).map(|s| s.trim().to_string()).unwrap_or_default();
    format!("{}/{}", read("/proc/sys/kernel/hostname"), read("/proc/sys/kernel/random/boot_id"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn member(id: &str) -> Member {
        Member {
            id: id.into(),
            tcp: "10.0.0.1:7370".into(),
            unix_socket: Some("/run/kvtide/owner.sock".into()),
            host: host_identity(),
            generation: 1,
            capacity_bytes: 1 << 30,
            used_bytes: 0,
            objects: 0,
            ssd_bytes: 0,
        }
    }

    #[test]
    fn records_round_trip_and_garbage_is_refused_with_a_reason() {
        let prefix = members_prefix("c1");
        let good = member("a");
        let key = format!("{prefix}a");
        let bytes = serde_json::to_vec(&good).unwrap();
        assert_eq!(parse_member(&prefix, key.as_bytes(), &bytes).unwrap(), good);

        let cases: Vec<(String, Vec<u8>, &str)> = vec![
            (key.clone(), b"garbage".to_vec(), "not a member record"),
            (key.clone(), vec![b' '; MAX_MEMBER_BYTES + 1], "record of"),
            (format!("{prefix}b"), bytes.clone(), "under the key of"),
            (key.clone(), serde_json::to_vec(&Member { tcp: "nope".into(), ..good.clone() }).unwrap(), "HOST:PORT"),
            (key.clone(), serde_json::to_vec(&Member { id: "a/b".into(), ..good.clone() }).unwrap(), "contains"),
            (
                key.clone(),
                serde_json::to_vec(&Member { unix_socket: Some("rel.sock".into()), ..good.clone() }).unwrap(),
                "absolute",
            ),
            ("/elsewhere/a".into(), bytes.clone(), "outside"),
        ];
        for (key, value, why) in cases {
            let e = parse_member(&prefix, key.as_bytes(), &value).unwrap_err();
            assert!(e.contains(why), "{key}: {e} (expected {why:?})");
        }
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("cluster name", "prod-1.kv_cache").is_ok());
        assert!(check_name("cluster name", "").is_err());
        assert!(check_name("cluster name", "a/b").is_err());
        assert!(check_name("cluster name", &"x".repeat(MAX_ID_BYTES + 1)).is_err());
        assert!(check_address("[::1]:7370").is_ok());
        assert!(check_address(":7370").is_err());
    }
}
