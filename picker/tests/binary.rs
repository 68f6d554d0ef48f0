//! The `kvroute-picker` binary: prints `READY` once its listeners are bound, and refuses an invalid
//! config with a non-zero exit and a message naming the problem.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn write_config(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-picker-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("picker.yaml");
    std::fs::write(&path, text).unwrap();
    path
}

fn tokenizer_dir() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer-qwen2.5").display().to_string()
}

#[test]
fn prints_ready_then_stops_on_sigterm() {
    let config = write_config(
        "ok",
        &format!(
            "ext_proc_addr: 127.0.0.1:0\ningest_addr: 127.0.0.1:0\ninsecure_ingest: true\nadmin_addr: 127.0.0.1:0\n\
             pool_file: pool.yaml\nmodels:\n  - name: m\n    tokenizer: {}\n",
            tokenizer_dir()
        ),
    );
    std::fs::write(config.with_file_name("pool.yaml"), "pods: [{name: p, ip: 127.0.0.1, ports: [8000]}]\n").unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-picker"))
        .args(["--config", config.to_str().unwrap(), "--log-level", "warn"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(Duration::from_secs(30));
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(line.unwrap().trim(), "READY");
    assert!(status.is_some_and(|s| s.success()), "picker did not exit cleanly on SIGTERM: {status:?}");
}

#[test]
fn invalid_config_exits_non_zero_with_message() {
    let cases = [
        (
            "weights",
            "scoring: {weights: {cache: 0.9, load: 0.2, queue: 0.1, health: 0.05, adapter: 0.05}}\n",
            "scoring",
        ),
        ("unknown", "ext_proc_adr: 127.0.0.1:1\n", "ext_proc_adr"),
        ("tokenizer", "models: [{name: m, tokenizer: no-such-dir, mode: precise}]\n", "tokenizer.json"),
        // The pool is the only source of candidates: no pool source, no start.
        ("no-pool", "models: [{name: m}]\n", "--pool-name"),
        ("missing-pool-file", "insecure_ingest: true\npool_file: no-such-pool.yaml\n", "no-such-pool.yaml"),
        // Neither ingest_tls nor insecure_ingest: plaintext ingest is never a default.
        (
            "insecure",
            "ext_proc_addr: 127.0.0.1:0\ningest_addr: 127.0.0.1:0\nadmin_addr: 127.0.0.1:0\npool_file: pool.yaml\n",
            "ingest is not secured",
        ),
        (
            "missing tls",
            "pool_file: pool.yaml\ningest_tls: {ca_file: /nonexistent/ca.crt, cert_file: /nonexistent/tls.crt, key_file: /nonexistent/tls.key}\n",
            "/nonexistent/ca.crt",
        ),
    ];
    for (name, yaml, needle) in cases {
        let config = write_config(name, yaml);
        let out = Command::new(env!("CARGO_BIN_EXE_kvroute-picker"))
            .args(["--config", config.to_str().unwrap()])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{name}: a config error exits 2 (README \"Command line\")");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(needle), "{name}: stderr lacks {needle:?}: {stderr}");
        assert!(!String::from_utf8_lossy(&out.stdout).contains("READY"));
    }
}

/// `--check-config` validates without binding (the listeners' ports stay free) and exits 0; an
/// invalid config exits 2 the same way as at start; `--version` names the commit; a port already
/// taken is a runtime failure, exit 1.
#[test]
fn check_config_version_and_exit_codes() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let good = write_config(
        "check",
        &format!(
            "ext_proc_addr: 127.0.0.1:{port}\nhealth_addr: 127.0.0.1:0\ningest_addr: 127.0.0.1:0\nadmin_addr: 127.0.0.1:0\n\
             insecure_ingest: true\npool_file: pool.yaml\nmodels: [{{name: m, tokenizer: {}}}]\n",
            tokenizer_dir()
        ),
    );
    std::fs::write(good.with_file_name("pool.yaml"), "pods: [{name: p, ip: 127.0.0.1, ports: [8000]}]\n").unwrap();
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_kvroute-picker")).args(args).stdin(Stdio::null()).output().unwrap()
    };
    let out = run(&["--config", good.to_str().unwrap(), "--check-config"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "config OK");
    // Served for real, the same config meets the taken port: runtime failure.
    let out = run(&["--config", good.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains(&port.to_string()));
    let bad = write_config("check-bad", "scoring: {max_queue: 0}\n");
    assert_eq!(run(&["--config", bad.to_str().unwrap(), "--check-config"]).status.code(), Some(2));
    assert_eq!(run(&["--no-such-flag"]).status.code(), Some(2), "usage error");
    let out = run(&["--version"]);
    assert!(out.status.success());
    let v = String::from_utf8_lossy(&out.stdout);
    assert!(v.starts_with("kvroute-picker 0.") && v.contains("(commit "), "{v}");
    assert!(!v.contains("(commit )"), "{v}");
}
