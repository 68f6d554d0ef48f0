//! Where the harness finds the workspace, the binaries and Envoy.

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};

/// The workspace root, where the fixtures, `.tools/` and `target/kvroute-runs/` are:
/// `$KVROUTE_ROOT`, else the tree this crate was built in (two levels above it) while it exists,
/// else the first ancestor of the running executable or of the current directory that holds
/// `tests/fixtures/tokenizer-qwen2.5` (a copied tree, or binaries moved out of their build
/// tree), else the build tree anyway (errors then name the missing file). The current directory
/// does not matter otherwise: the harness binaries run from anywhere.
pub fn repo_root() -> PathBuf {
    if let Some(root) = std::env::var_os("KVROUTE_ROOT") {
        return PathBuf::from(root);
    }
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let built = here.parent().and_then(Path::parent).map(Path::to_path_buf).unwrap_or_else(|| here.to_path_buf());
    let is_root = |p: &Path| p.join("tests/fixtures/tokenizer-qwen2.5").is_dir();
    if is_root(&built) {
        return built;
    }
    let starts = [std::env::current_exe().ok(), std::env::current_dir().ok()];
    starts
        .into_iter()
        .flatten()
        .find_map(|s| s.ancestors().find(|a| is_root(a)).map(Path::to_path_buf))
        .unwrap_or(built)
}

/// The directory holding the workspace's binaries: `$KVROUTE_BIN_DIR`, else the directory of the
/// running executable when it holds `kvroute-picker` (the demo binary), else
/// `$CARGO_TARGET_DIR|target` / (`debug`|`release`).
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KVROUTE_BIN_DIR") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::current_exe().ok().and_then(|p| p.parent().map(Path::to_path_buf))
        && dir.join("kvroute-picker").exists()
    {
        return dir;
    }
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| repo_root().join("target"));
    target.join(if cfg!(debug_assertions) { "debug" } else { "release" })
}

/// Path of one of the workspace's binaries; an error says how to build it.
pub fn binary(name: &str) -> Result<PathBuf> {
    let path = bin_dir().join(name);
    if !path.exists() {
        bail!("{} not found: build the workspace binaries first (`cargo build --bins`)", path.display());
    }
    Ok(path)
}

/// Envoy installed by `scripts/install-envoy` (or `$KVROUTE_ENVOY`).
pub fn envoy() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("KVROUTE_ENVOY") {
        return Ok(PathBuf::from(p));
    }
    let path = repo_root().join(".tools/envoy/envoy/_bin/envoy");
    if !path.exists() {
        bail!("Envoy not found at {}: run scripts/install-envoy", path.display());
    }
    Ok(path)
}

/// `vllm` of the venv `scripts/install-vllm` made (or `$KVROUTE_VLLM`).
pub fn vllm() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("KVROUTE_VLLM") {
        return Ok(PathBuf::from(p));
    }
    let path = repo_root().join(".tools/vllm/bin/vllm");
    if !path.exists() {
        bail!("vLLM not found at {}: run scripts/install-vllm", path.display());
    }
    Ok(path)
}

/// The random-weight model directory `scripts/install-vllm` built (`scripts/make-vllm-model`).
pub fn vllm_model() -> Result<PathBuf> {
    let path = repo_root().join(".tools/vllm-model");
    if !path.join("config.json").exists() {
        bail!("the vLLM test model is missing at {}: run scripts/install-vllm", path.display());
    }
    Ok(path)
}

/// The Qwen2.5 tokenizer directory the emulated engines and the picker share.
pub fn tokenizer_dir() -> PathBuf {
    repo_root().join("tests/fixtures/tokenizer-qwen2.5")
}

/// A fresh, empty work directory `target/kvroute-runs/<label>` for one run's configs and logs.
pub fn work_dir(label: &str) -> Result<PathBuf> {
    let dir = repo_root().join("target/kvroute-runs").join(label);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// Ports handed out by [`free_port`]: below Linux's default ephemeral range (32768–60999).
const PORTS: std::ops::Range<u16> = 20_000..32_000;

/// A TCP port that was free a moment ago on every interface, for a process started later to bind.
///
/// Chosen below the ephemeral range on purpose: a port the kernel picked for `bind(0)` is also a
/// candidate for the source port of any outgoing connection (clients, Envoy, agents), so between
/// this check and the real bind another connection could take it (seen as an engine that never
/// became ready). Ports are taken in turn from a per-process random start, so one process never
/// hands out a port twice and concurrent test processes rarely meet.
pub fn free_port() -> Result<u16> {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(u32::MAX);
    let span = u32::from(PORTS.end - PORTS.start);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        rand::random_range(0..span),
        std::sync::atomic::Ordering::Relaxed,
        std::sync::atomic::Ordering::Relaxed,
    );
    for _ in 0..span {
        let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % span;
        let port = PORTS.start + u16::try_from(k).unwrap_or(0);
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return Ok(port);
        }
    }
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("binding an ephemeral port")?;
    Ok(l.local_addr()?.port())
}
