//! The owner's Unix socket file: created owner-only, then given its group and mode (`[owner]
//! socket_mode`, `socket_group`, like Redis's `unixsocketperm`), in a directory that lets that
//! group through; and the reading of those two settings (which modes are acceptable is
//! `config`'s rule).
//!
//! Owns who may reach the socket. Never loosens a directory it did not create (a directory that
//! keeps the socket's group out is an error naming the fix), never removes a file that is not a
//! stale socket, and never accepts or serves a connection.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use super::config::{check_mode_with_group, check_socket_mode, OwnerError};

/// Reads an octal mode: `0660`, `660` or `0o660`, checked by `check_socket_mode`.
pub fn parse_socket_mode(text: &str) -> Result<u32, String> {
    let trimmed = text.trim();
    let digits = trimmed.strip_prefix("0o").unwrap_or(trimmed);
    if digits.is_empty() || digits.len() > 6 || !digits.bytes().all(|b| (b'0'..=b'7').contains(&b)) {
        return Err(format!("{text:?} is not an octal mode like \"0660\""));
    }
    let mode = u32::from_str_radix(digits, 8).map_err(|e| format!("{text:?}: {e}"))?;
    check_socket_mode(mode)?;
    Ok(mode)
}

/// A group name or a numeric gid (a number is taken as it is: containers often use gids that no
/// group file names).
pub fn group_id(text: &str) -> Result<u32, String> {
    let name = text.trim();
    if name.is_empty() {
        return Err("an empty group name".into());
    }
    if let Ok(gid) = name.parse::<u32>() {
        return Ok(gid);
    }
    let c_name = CString::new(name).map_err(|_| format!("{name:?} is not a group name"))?;
    let mut buf = vec![0u8; 4096];
    loop {
        // SAFETY: group is plain data; getgrnam_r fills it with pointers into `buf`.
        let mut group: libc::group = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::group = std::ptr::null_mut();
        // SAFETY: a NUL-terminated name, a live struct and a buffer of the given length; only
        // gr_gid is read from the result, before `buf` changes.
        let rc =
            unsafe { libc::getgrnam_r(c_name.as_ptr(), &mut group, buf.as_mut_ptr().cast(), buf.len(), &mut found) };
        if rc == libc::ERANGE && buf.len() < 1 << 20 {
            buf.resize(buf.len() * 2, 0);
            continue;
        }
        if rc != 0 {
            return Err(format!("cannot look up group {name:?}: {}", io::Error::from_raw_os_error(rc)));
        }
        if found.is_null() {
            return Err(format!("unknown group {name:?}: give an existing group name or a numeric gid"));
        }
        return Ok(group.gr_gid);
    }
}

/// Binds the Unix socket at `path` with `mode` and `group` (None: the owner's group). A stale
/// socket file is replaced; a live one means another owner serves there. When the mode lets a
/// group in, the socket's directory must let that group through: a missing directory is
/// created for it (0710, that group), an existing one is checked and never changed.
pub(super) fn bind(path: &Path, mode: u32, group: Option<u32>) -> Result<UnixListener, OwnerError> {
    check_mode_with_group(mode, group).map_err(|e| OwnerError::Config(format!("socket_mode: {e}")))?;
    remove_stale(path)?;
    // SAFETY: getegid has no inputs and cannot fail.
    let gid = group.unwrap_or_else(|| unsafe { libc::getegid() });
    if mode & 0o070 != 0 {
        prepare_directory(path, gid, group.is_some())?;
    }
    let bind_error = |source| OwnerError::Bind { what: format!("unix {}", path.display()), source };
    let listener = bind_owner_only(path).map_err(bind_error)?;
    if let Some(gid) = group {
        std::os::unix::fs::lchown(path, None, Some(gid)).map_err(|e| {
            OwnerError::Config(format!(
                "cannot give the socket {} to group {gid}: {e} (the owner's user must be a member of the group)",
                path.display()
            ))
        })?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|source| OwnerError::Bind { what: format!("chmod {mode:04o} {}", path.display()), source })?;
    Ok(listener)
}

/// Removes a socket file no owner serves any more. A live socket is `AlreadyRunning`; a file
/// that is not a socket, or one this user may not probe, is left alone and refused.
fn remove_stale(path: &Path) -> Result<(), OwnerError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => return Err(OwnerError::Bind { what: format!("stat {}", path.display()), source }),
    };
    if !meta.file_type().is_socket() {
        return Err(OwnerError::Config(format!("{} exists and is not a socket; not replacing it", path.display())));
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(OwnerError::AlreadyRunning(path.to_path_buf())),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => std::fs::remove_file(path)
            .map_err(|source| OwnerError::Bind { what: format!("remove stale socket {}", path.display()), source }),
        Err(source) => Err(OwnerError::Bind {
            what: format!("probe the existing socket {} (left in place)", path.display()),
            source,
        }),
    }
}

/// Searchable by members of `gid`: by others, or by the group when it is `gid`.
fn group_can_search(meta: &std::fs::Metadata, gid: u32) -> bool {
    meta.mode() & 0o001 != 0 || (meta.gid() == gid && meta.mode() & 0o010 != 0)
}

/// Lets group `gid` reach the socket's directory: creates it (0710, that group) when missing;
/// refuses an existing directory the group cannot search; warns about ancestors it may not
/// search (a member could still pass through another group it is in).
fn prepare_directory(path: &Path, gid: u32, chown: bool) -> Result<(), OwnerError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    match std::fs::metadata(dir) {
        Ok(meta) => {
            if !group_can_search(&meta, gid) {
                return Err(OwnerError::Config(format!(
                    "the socket's directory {} (mode {:04o}, group {}) does not let group {gid} through to the \
                     socket; the owner does not loosen a directory it did not create: put the socket in a directory \
                     of its own (unix_socket = \"/run/kvtide/owner.sock\", created 0710 for the group when missing) \
                     or run: chgrp {gid} {dir} && chmod g+x {dir}",
                    dir.display(),
                    meta.mode() & 0o7777,
                    meta.gid(),
                    dir = dir.display()
                )));
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new().mode(0o700).create(dir).map_err(|source| OwnerError::Bind {
                what: format!("create the socket's directory {}", dir.display()),
                source,
            })?;
            if chown {
                std::os::unix::fs::chown(dir, None, Some(gid)).map_err(|e| {
                    OwnerError::Config(format!(
                        "cannot give the socket's directory {} to group {gid}: {e} (the owner's user must be a \
                         member of the group)",
                        dir.display()
                    ))
                })?;
            }
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o710))
                .map_err(|source| OwnerError::Bind { what: format!("chmod 0710 {}", dir.display()), source })?;
        }
        Err(source) => return Err(OwnerError::Bind { what: format!("stat {}", dir.display()), source }),
    }
    let mut ancestor = dir.canonicalize().ok().and_then(|d| d.parent().map(Path::to_path_buf));
    while let Some(a) = ancestor {
        if let Ok(meta) = std::fs::metadata(&a) {
            if !group_can_search(&meta, gid) {
                tracing::warn!(
                    directory = %a.display(),
                    mode = format!("{:04o}", meta.mode() & 0o7777),
                    group = gid,
                    "members of the socket's group may not be able to pass through this directory to the socket"
                );
            }
        }
        ancestor = a.parent().map(Path::to_path_buf);
    }
    Ok(())
}

/// A listening Unix socket at `path` whose file is created with the owner's bits only (the
/// socket's mode is set before `bind`, which creates the file from it), so no other user can
/// connect before the final mode and group are in place.
fn bind_owner_only(path: &Path) -> io::Result<UnixListener> {
    // SAFETY: sockaddr_un is plain data; all zeroes is a valid empty address.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    let bytes = path.as_os_str().as_bytes();
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("a Unix socket path must be 1 to {} bytes without NUL", addr.sun_path.len() - 1),
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (slot, byte) in addr.sun_path.iter_mut().zip(bytes) {
        *slot = *byte as libc::c_char;
    }
    // SAFETY: plain syscall; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: fchmod on a socket we own; Linux creates the bound file from this mode (less the
    // umask).
    if unsafe { libc::fchmod(socket.as_raw_fd(), 0o600) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    // SAFETY: addr is a valid sockaddr_un of at least `len` bytes, read during the call.
    if unsafe { libc::bind(socket.as_raw_fd(), (&addr as *const libc::sockaddr_un).cast(), len as libc::socklen_t) }
        != 0
    {
        return Err(io::Error::last_os_error());
    }
    // A backlog of -1 is the kernel's maximum (somaxconn): a host's workers may all connect at
    // once when the owner starts.
    // SAFETY: plain syscall on a bound socket we own.
    if unsafe { libc::listen(socket.as_raw_fd(), -1) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(UnixListener::from(socket))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kvtide-socket-file-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        dir
    }

    fn mode_of(path: &Path) -> u32 {
        std::fs::symlink_metadata(path).expect("stat").mode() & 0o7777
    }

    #[test]
    fn modes_are_octal_permission_bits_never_writable_by_others() {
        assert_eq!(parse_socket_mode("0600"), Ok(0o600));
        assert_eq!(parse_socket_mode("660"), Ok(0o660));
        assert_eq!(parse_socket_mode("0o640"), Ok(0o640));
        assert!(parse_socket_mode("0666").expect_err("o+w").contains("every user"));
        assert!(parse_socket_mode("0662").expect_err("o+w").contains("every user"));
        assert!(parse_socket_mode("04660").expect_err("setuid").contains("beyond the permission bits"));
        assert!(parse_socket_mode("01660").expect_err("sticky").contains("beyond the permission bits"));
        assert!(parse_socket_mode("0400").expect_err("owner rw").contains("0600 at least"));
        for bad in ["", "rw", "0689", "-600", "0x1b0", "1234567"] {
            assert!(parse_socket_mode(bad).expect_err(bad).contains("not an octal mode"), "{bad}");
        }
        assert!(check_mode_with_group(0o600, Some(5)).expect_err("no group write").contains("0660"));
        assert_eq!(check_mode_with_group(0o660, Some(5)), Ok(()));
        assert_eq!(check_mode_with_group(0o600, None), Ok(()));
    }

    #[test]
    fn groups_are_names_or_numbers() {
        assert_eq!(group_id("0"), Ok(0));
        assert_eq!(group_id(" 4242 "), Ok(4242), "a gid no group file names is taken as it is");
        assert_eq!(group_id("root"), Ok(0));
        let e = group_id("kvtide-no-such-group").expect_err("unknown");
        assert!(e.contains("unknown group \"kvtide-no-such-group\""), "{e}");
        assert!(group_id("").is_err());
        assert!(group_id("a\0b").is_err());
    }

    #[test]
    fn the_socket_gets_its_mode_and_group_and_a_directory_made_for_the_group() {
        let dir = temp_dir("mode");
        // Owner-only (the default): the socket is 0600 and its directory is not touched.
        let private = dir.join("owner.sock");
        let listener = bind(&private, 0o600, None).expect("bind 0600");
        assert_eq!(mode_of(&private), 0o600);
        // A live socket is another owner; a stale one is replaced; a file that is no socket is left.
        assert!(matches!(bind(&private, 0o600, None), Err(OwnerError::AlreadyRunning(_))));
        drop(listener);
        drop(bind(&private, 0o600, None).expect("a stale socket is replaced"));
        let plain = dir.join("plain-file");
        std::fs::write(&plain, b"data").expect("file");
        let e = bind(&plain, 0o600, None).expect_err("not a socket").to_string();
        assert!(e.contains("is not a socket"), "{e}");
        assert_eq!(std::fs::read(&plain).expect("still there"), b"data");

        // A group: the missing directory is created 0710 for it, the socket 0660 in that group.
        // SAFETY: getegid has no inputs.
        let gid = unsafe { libc::getegid() };
        let run = dir.join("run");
        let shared = run.join("owner.sock");
        let _listener = bind(&shared, 0o660, Some(gid)).expect("bind 0660");
        assert_eq!(mode_of(&shared), 0o660);
        assert_eq!(std::fs::metadata(&shared).expect("stat").gid(), gid);
        assert_eq!(mode_of(&run), 0o710);
        assert_eq!(std::fs::metadata(&run).expect("stat").gid(), gid);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_existing_directory_that_keeps_the_group_out_is_refused_and_left_as_it_was() {
        let dir = temp_dir("closed");
        let private = dir.join("data");
        std::fs::create_dir(&private).expect("dir");
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let e = bind(&private.join("owner.sock"), 0o660, Some(4242)).expect_err("closed directory").to_string();
        assert!(e.contains("does not let group 4242 through") && e.contains("/run/kvtide/owner.sock"), "{e}");
        assert_eq!(mode_of(&private), 0o700, "never loosened");
        assert!(!private.join("owner.sock").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
