//! The data directory on a real file system: its format marker and each shard's segment files.
//!
//! Owns creating, checking and opening files (at open time only; never on a shard's hot path):
//! a `FORMAT` file naming the format version, shard count and segment size, and per shard
//! `shard-NNN/seg-NNNNNN.kvt` files preallocated with `fallocate` and opened with `O_DIRECT`
//! (with a clear warning and buffered I/O where the file system refuses it).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::record::{BLOCK_BYTES, FORMAT_VERSION, OLDEST_READABLE_VERSION};

/// Errors opening a data directory.
#[derive(Debug, thiserror::Error)]
pub enum DataDirError {
    #[error("data directory {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error(
        "data directory {path} was written by kvtide format version {found}; this build reads versions {OLDEST_READABLE_VERSION} to {FORMAT_VERSION}"
    )]
    FormatVersion { path: String, found: String },
    #[error(
        "data directory {path} was created with {found}; this store is configured with {expected}. Leave the SSD \
         size, segment size and shard count unset to adopt the directory's layout, set them to match it, or use a new \
         directory"
    )]
    Layout { path: String, found: String, expected: String },
    #[error("data directory {path} has an unreadable FORMAT file: {reason}")]
    BadFormatFile { path: String, reason: String },
    #[error("segment size {0} must be a multiple of 4 KiB and at least 64 KiB")]
    SegmentSize(u64),
    #[error("the SSD tier of {ssd_bytes} bytes holds less than two {segment_bytes}-byte segments per shard ({shards} shards)")]
    TooSmall { ssd_bytes: u64, segment_bytes: u64, shards: usize },
    #[error("no space for the segment files in {path} (ENOSPC while preallocating {bytes} bytes)")]
    NoSpace { path: String, bytes: u64 },
}

fn io(path: &Path, source: std::io::Error) -> DataDirError {
    DataDirError::Io { path: path.display().to_string(), source }
}

/// One shard's open segment files.
#[derive(Debug)]
pub struct ShardFiles {
    /// For io_uring (O_DIRECT when `direct`).
    pub io_fds: Vec<OwnedFd>,
    /// Buffered descriptors for the recovery scan (unaligned reads).
    pub scan_fds: Vec<OwnedFd>,
    pub direct: bool,
    pub segment_bytes: u64,
}

/// A validated data directory.
#[derive(Debug)]
pub struct DataDir {
    pub path: PathBuf,
    pub shards: usize,
    pub segment_bytes: u64,
    pub segments_per_shard: u32,
}

/// The layout a data directory was created with (its FORMAT file): what a store opened with
/// derived sizes adopts, so a restart never computes a different layout than the first start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordedLayout {
    pub shards: usize,
    pub segment_bytes: u64,
    pub segments_per_shard: u32,
}

impl RecordedLayout {
    /// The SSD tier size that reproduces this layout exactly.
    pub fn ssd_bytes(&self) -> u64 {
        self.shards as u64 * u64::from(self.segments_per_shard) * self.segment_bytes
    }

    /// The layout recorded in `path`, or None when it has none yet (a new directory).
    pub fn read(path: &Path) -> Result<Option<RecordedLayout>, DataDirError> {
        let format_path = path.join("FORMAT");
        let text = match std::fs::read_to_string(&format_path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(&format_path, e)),
        };
        let p = path.display().to_string();
        let bad = |reason: &str| DataDirError::BadFormatFile { path: p.clone(), reason: reason.into() };
        let layout = text.lines().nth(1).ok_or_else(|| bad("missing layout line"))?;
        let (mut shards, mut segment_bytes, mut segments_per_shard) = (None, None, None);
        for field in layout.split_whitespace() {
            match field.split_once('=') {
                Some(("shards", v)) => shards = v.parse::<usize>().ok(),
                Some(("segment_bytes", v)) => segment_bytes = v.parse::<u64>().ok(),
                Some(("segments_per_shard", v)) => segments_per_shard = v.parse::<u32>().ok(),
                _ => return Err(bad("unknown layout field")),
            }
        }
        match (shards, segment_bytes, segments_per_shard) {
            (Some(shards), Some(segment_bytes), Some(segments_per_shard)) if shards > 0 => {
                Ok(Some(RecordedLayout { shards, segment_bytes, segments_per_shard }))
            }
            _ => Err(bad("incomplete layout line")),
        }
    }
}

impl DataDir {
    /// Creates or checks `path` for `shards` shards of `ssd_bytes / shards` bytes each.
    pub fn open(path: &Path, ssd_bytes: u64, shards: usize, segment_bytes: u64) -> Result<DataDir, DataDirError> {
        if !segment_bytes.is_multiple_of(BLOCK_BYTES) || segment_bytes < 16 * BLOCK_BYTES {
            return Err(DataDirError::SegmentSize(segment_bytes));
        }
        let per_shard = ssd_bytes / shards.max(1) as u64;
        let segments_per_shard = (per_shard / segment_bytes) as u32;
        if segments_per_shard < 2 {
            return Err(DataDirError::TooSmall { ssd_bytes, segment_bytes, shards });
        }
        std::fs::create_dir_all(path).map_err(|e| io(path, e))?;
        let format_path = path.join("FORMAT");
        let expected = format!("shards={shards} segment_bytes={segment_bytes} segments_per_shard={segments_per_shard}");
        match std::fs::read_to_string(&format_path) {
            Ok(text) => {
                if check_format(path, &text, &expected)? < FORMAT_VERSION {
                    // Older records stay readable; new ones are written in this version, which
                    // older builds must refuse.
                    tracing::info!(path = %path.display(), "data directory upgraded to format version {FORMAT_VERSION}");
                    write_format(path, &expected)?;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => write_format(path, &expected)?,
            Err(e) => return Err(io(&format_path, e)),
        }
        Ok(DataDir { path: path.to_path_buf(), shards, segment_bytes, segments_per_shard })
    }

    /// Opens (creating and preallocating where missing) shard `shard`'s segment files.
    pub fn open_shard(&self, shard: usize) -> Result<ShardFiles, DataDirError> {
        let dir = self.path.join(format!("shard-{shard:03}"));
        std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
        let mut io_fds = Vec::new();
        let mut scan_fds = Vec::new();
        let mut direct = true;
        for seg in 0..self.segments_per_shard {
            let path = dir.join(format!("seg-{seg:06}.kvt"));
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(|e| io(&path, e))?;
            preallocate(&file, &path, self.segment_bytes)?;
            let direct_file = if direct {
                match OpenOptions::new().read(true).write(true).custom_flags(libc::O_DIRECT).open(&path) {
                    Ok(f) => Some(f),
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                        tracing::warn!(path = %path.display(), "file system refuses O_DIRECT; SSD tier uses buffered I/O");
                        direct = false;
                        None
                    }
                    Err(e) => return Err(io(&path, e)),
                }
            } else {
                None
            };
            let io_file = match direct_file {
                Some(f) => f,
                None => OpenOptions::new().read(true).write(true).open(&path).map_err(|e| io(&path, e))?,
            };
            io_fds.push(OwnedFd::from(io_file));
            scan_fds.push(OwnedFd::from(file));
        }
        Ok(ShardFiles { io_fds, scan_fds, direct, segment_bytes: self.segment_bytes })
    }
}

/// Writes the FORMAT file atomically (a temporary file renamed over it, both synced).
fn write_format(path: &Path, layout: &str) -> Result<(), DataDirError> {
    let format_path = path.join("FORMAT");
    let tmp = path.join("FORMAT.tmp");
    let mut f = File::create(&tmp).map_err(|e| io(&tmp, e))?;
    writeln!(f, "kvtide-ssd-format={FORMAT_VERSION}\n{layout}").map_err(|e| io(&tmp, e))?;
    f.sync_all().map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, &format_path).map_err(|e| io(&format_path, e))?;
    File::open(path).and_then(|d| d.sync_all()).map_err(|e| io(path, e))
}

/// Checks a FORMAT file against the configured layout; returns the version it names.
fn check_format(path: &Path, text: &str, expected: &str) -> Result<u16, DataDirError> {
    let p = path.display().to_string();
    let mut lines = text.lines();
    let version = lines.next().and_then(|l| l.strip_prefix("kvtide-ssd-format=")).ok_or_else(|| {
        DataDirError::BadFormatFile { path: p.clone(), reason: "missing kvtide-ssd-format line".into() }
    })?;
    let found = match version.trim().parse::<u16>() {
        Ok(v) if (OLDEST_READABLE_VERSION..=FORMAT_VERSION).contains(&v) => v,
        _ => return Err(DataDirError::FormatVersion { path: p, found: version.trim().to_string() }),
    };
    let layout = lines.next().unwrap_or("").trim();
    if layout != expected {
        return Err(DataDirError::Layout { path: p, found: layout.to_string(), expected: expected.to_string() });
    }
    Ok(found)
}

fn preallocate(file: &File, path: &Path, bytes: u64) -> Result<(), DataDirError> {
    // SAFETY: fallocate on a descriptor we own; no pointers are passed.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, bytes as libc::off_t) };
    if rc == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENOSPC) => Err(DataDirError::NoSpace { path: path.display().to_string(), bytes }),
        // File systems without fallocate: fall back to sizing the file.
        Some(libc::EOPNOTSUPP) => file.set_len(bytes).map_err(|e| io(path, e)),
        _ => Err(io(path, e)),
    }
}

impl ShardFiles {
    /// Scans every segment, `threads` at a time (segments are independent, and a recovery scan
    /// at queue depth one leaves most of an SSD idle).
    pub fn scan_all(&self, threads: usize) -> std::io::Result<Vec<super::SegmentScan>> {
        let count = self.scan_fds.len();
        let next = std::sync::atomic::AtomicUsize::new(0);
        let results: Vec<std::sync::Mutex<Option<std::io::Result<super::SegmentScan>>>> =
            (0..count).map(|_| std::sync::Mutex::new(None)).collect();
        std::thread::scope(|scope| {
            for _ in 0..threads.clamp(1, count.max(1)) {
                scope.spawn(|| {
                    let mut reader = FileReader { files: self };
                    loop {
                        let segment = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if segment >= count {
                            break;
                        }
                        let scan = super::scan_segment(&mut reader, segment as u32);
                        *results[segment].lock().unwrap_or_else(|p| p.into_inner()) = Some(scan);
                    }
                });
            }
        });
        results
            .into_iter()
            .map(|cell| {
                cell.into_inner()
                    .unwrap_or_else(|p| p.into_inner())
                    .unwrap_or_else(|| Err(std::io::Error::other("segment was not scanned")))
            })
            .collect()
    }
}

/// Reads segment files with pread from any thread (recovery scans).
pub struct FileReader<'a> {
    files: &'a ShardFiles,
}

impl super::recovery::ReadAt for FileReader<'_> {
    fn read_at(&mut self, file: super::FileId, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        // Scans read 4 KiB-aligned windows at 4 KiB offsets, so they can bypass the page cache
        // like the rest of the tier (about twice the speed of buffered reads here).
        let fds = if self.files.direct && is_aligned(offset, buf) { &self.files.io_fds } else { &self.files.scan_fds };
        let fd = fds.get(file as usize).ok_or_else(|| std::io::Error::from_raw_os_error(libc::EBADF))?;
        pread(fd, offset, buf)
    }

    fn file_bytes(&self) -> u64 {
        self.files.segment_bytes
    }
}

fn is_aligned(offset: u64, buf: &[u8]) -> bool {
    let block = super::record::BLOCK_BYTES;
    offset.is_multiple_of(block)
        && (buf.len() as u64).is_multiple_of(block)
        && (buf.as_ptr() as u64).is_multiple_of(block)
}

/// Synchronous pread on a buffered descriptor (recovery scans).
pub fn pread(fd: &OwnedFd, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        // SAFETY: `buf` is valid for writes of buf.len() bytes; fd is open.
        let n = unsafe { libc::pread(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), offset as libc::off_t) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(name: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("kvtide-files-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        p
    }

    #[test]
    fn creates_checks_and_refuses_other_layouts() {
        let p = tmpdir("layout");
        let d = DataDir::open(&p, 8 << 20, 2, 1 << 20).expect("create");
        assert_eq!(d.segments_per_shard, 4);
        let files = d.open_shard(1).expect("shard");
        assert_eq!(files.io_fds.len(), 4);
        assert_eq!(std::fs::metadata(p.join("shard-001/seg-000003.kvt")).expect("seg").len(), 1 << 20);
        DataDir::open(&p, 8 << 20, 2, 1 << 20).expect("reopen");
        let e = DataDir::open(&p, 8 << 20, 4, 1 << 20).expect_err("other shard count");
        assert!(matches!(e, DataDirError::Layout { .. }), "{e}");
        assert!(e.to_string().contains("unset to adopt"), "the error says how to proceed: {e}");
        assert_eq!(RecordedLayout::read(&tmpdir("no-format")).expect("read"), None);
        // A version 1 directory (the layout before per-block checksums) opens and is marked as
        // this version's, so older builds refuse it from now on.
        let layout = "shards=2 segment_bytes=1048576 segments_per_shard=4";
        let recorded = RecordedLayout::read(&p).expect("read").expect("recorded");
        assert_eq!(recorded, RecordedLayout { shards: 2, segment_bytes: 1 << 20, segments_per_shard: 4 });
        assert_eq!(recorded.ssd_bytes(), 8 << 20);
        std::fs::write(p.join("FORMAT"), format!("kvtide-ssd-format=1\n{layout}\n")).expect("write");
        DataDir::open(&p, 8 << 20, 2, 1 << 20).expect("a version 1 directory opens");
        let text = std::fs::read_to_string(p.join("FORMAT")).expect("read");
        assert_eq!(text, format!("kvtide-ssd-format={FORMAT_VERSION}\n{layout}\n"));
        std::fs::write(p.join("FORMAT"), "kvtide-ssd-format=99\nx\n").expect("write");
        let e = DataDir::open(&p, 8 << 20, 2, 1 << 20).expect_err("other version");
        assert!(e.to_string().contains("format version 99"), "{e}");
        let _ = std::fs::remove_dir_all(&p);
    }

    #[test]
    fn bad_sizes_and_unwritable_dirs_are_clear_errors() {
        assert!(matches!(DataDir::open(Path::new("/tmp/x"), 1 << 20, 1, 1000), Err(DataDirError::SegmentSize(_))));
        assert!(matches!(DataDir::open(&tmpdir("small"), 1 << 20, 2, 1 << 20), Err(DataDirError::TooSmall { .. })));
        let e = DataDir::open(Path::new("/proc/kvtide-cannot-exist"), 8 << 20, 1, 1 << 20).expect_err("unwritable");
        assert!(matches!(e, DataDirError::Io { .. }), "{e}");
    }
}
