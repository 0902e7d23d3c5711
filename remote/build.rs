//! Owns the build-time facts the owner reports (`GET /version`, `kvtide_build_info`): the git
//! commit of the checkout it is built from, when there is one (`BUILD_GIT_COMMIT` overrides
//! it). Never fails the build: without git or a checkout the commit is simply absent.

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !text.is_empty()).then_some(text)
}

/// Asks cargo to run this again when `path` (a file of the git directory) changes; a path that
/// does not exist is left out (cargo would rerun on every build).
fn watch(path: Option<String>) {
    if let Some(path) = path.filter(|p| Path::new(p).exists()) {
        println!("cargo:rerun-if-changed={path}");
    }
}

fn main() {
    println!("cargo:rerun-if-env-changed=BUILD_GIT_COMMIT");
    let commit = std::env::var("BUILD_GIT_COMMIT").ok().filter(|c| !c.is_empty()).or_else(|| {
        let commit = git(&["rev-parse", "--short=12", "HEAD"])?;
        // HEAD moves when a branch is switched; the branch's ref (or packed-refs) on a commit.
        watch(git(&["rev-parse", "--git-path", "HEAD"]));
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watch(git(&["rev-parse", "--git-path", &branch]));
        }
        watch(git(&["rev-parse", "--git-path", "packed-refs"]));
        Some(commit)
    });
    if let Some(commit) = commit {
        println!("cargo:rustc-env=BUILD_GIT_COMMIT={commit}");
    }
}
