//! Records the git commit the binaries are built from (for `--version` and
//! `inference_extension_info`), without network: `KVROUTE_GIT_COMMIT` from the environment (set by
//! image builds that have no `.git`), else `git rev-parse`, else "unknown".

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_owned();
    (!s.is_empty()).then_some(s)
}

fn main() {
    println!("cargo:rerun-if-env-changed=KVROUTE_GIT_COMMIT");
    let commit = std::env::var("KVROUTE_GIT_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(|| git(&["rev-parse", "--short=12", "HEAD"]))
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=KVROUTE_GIT_COMMIT={commit}");
    // Rebuild when HEAD moves (a worktree's HEAD lives under the common git dir's worktrees/).
    // Only this crate and the binaries' main modules depend on it, so a commit relinks the
    // binaries without recompiling the libraries.
    if let Some(p) = git(&["rev-parse", "--git-path", "HEAD"]) {
        println!("cargo:rerun-if-changed={p}");
    }
    if let Some(p) = git(&["rev-parse", "--git-common-dir"]) {
        println!("cargo:rerun-if-changed={p}/refs/heads");
        println!("cargo:rerun-if-changed={p}/packed-refs");
    }
}
