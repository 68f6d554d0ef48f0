//! The `kvroute-agent` binary as a process: NVML absent is a clear start-up error naming the
//! library and the mock option; SIGTERM is a graceful shutdown (the picker sees the report
//! stream end cleanly, the process exits 0 promptly).

#![allow(clippy::unwrap_used, clippy::expect_used)]
use kvroute_proto::agent::v1::agent_ingest_server::{AgentIngest, AgentIngestServer};
use kvroute_proto::agent::v1::{AgentMessage, PickerMessage, agent_message};
use std::pin::Pin;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

const BIN: &str = env!("CARGO_BIN_EXE_kvroute-agent");

fn write_config(dir: &std::path::Path, picker: &str, gpu_source: &str) -> std::path::PathBuf {
    let nobody = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr");
    let path = dir.join("agent.yaml");
    std::fs::write(
        &path,
        format!(
            "pickers: [\"{picker}\"]\ninsecure_ingest: true\ngpu_source: \"{gpu_source}\"\nmetrics_addr: 127.0.0.1:0\n\
             engines:\n  - pod: engine-0\n    endpoint: {nobody}\n    model: m\n    gpus: [0]\n"
        ),
    )
    .expect("write config");
    path
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kvroute-agent-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

#[test]
fn nvml_absent_is_a_clear_startup_error() {
    if kvroute_agent::gpu::nvml::NvmlGpuSource::new().is_ok() {
        eprintln!("NVML present on this host: nothing to check");
        return;
    }
    let dir = temp_dir("nvml");
    let cfg = write_config(&dir, "http://127.0.0.1:1", "nvml");
    let out = Command::new(BIN).arg("--config").arg(&cfg).output().expect("runs");
    assert!(!out.status.success(), "must fail without NVML");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("libnvidia-ml.so"), "names the missing library: {err}");
    assert!(err.contains("--gpu-source mock:"), "names the mock option: {err}");
    assert!(!err.contains("panicked") && !err.contains("stack backtrace"), "{err}");
    assert!(String::from_utf8_lossy(&out.stdout).trim().is_empty(), "no READY");
}

/// `--check-config` exits 0 on a valid config (mock GPUs) and 2 on an invalid one or a missing
/// mock scenario, like a failed start; `--version` names the commit; errors are printed once.
#[test]
fn check_config_version_and_exit_codes() {
    let dir = temp_dir("check");
    let scenario = concat!(env!("CARGO_MANIFEST_DIR"), "/scenarios/healthy.yaml");
    let good = write_config(&dir, "http://127.0.0.1:1", &format!("mock:{scenario}"));
    let run = |args: &[&str]| Command::new(BIN).args(args).stdin(Stdio::null()).output().expect("runs");
    let out = run(&["--config", good.to_str().unwrap(), "--check-config"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "config OK");
    let out = run(&["--config", good.to_str().unwrap(), "--check-config", "--gpu-source", "mock:/no/such.yaml"]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    let out = run(&["--config", "/no/such/agent.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("No such file or directory").count(), 1, "cause printed once: {err}");
    assert_eq!(run(&["--no-such-flag"]).status.code(), Some(2));
    let out = run(&["--version"]);
    let v = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && v.contains("(commit ") && !v.contains("(commit )"), "{v}");
}

/// How each report stream ended: `Ok` (clean end of stream) or `Err(status)`.
struct Picker {
    events: mpsc::UnboundedSender<Result<AgentMessage, String>>,
}

#[tonic::async_trait]
impl AgentIngest for Picker {
    type ReportStream = Pin<Box<dyn Stream<Item = Result<PickerMessage, Status>> + Send>>;
    async fn report(&self, req: Request<Streaming<AgentMessage>>) -> Result<Response<Self::ReportStream>, Status> {
        let mut inbound = req.into_inner();
        let events = self.events.clone();
        let (keep, rx) = mpsc::channel::<Result<PickerMessage, Status>>(1);
        tokio::spawn(async move {
            loop {
                match inbound.next().await {
                    Some(Ok(m)) => {
                        let _ = events.send(Ok(m));
                    }
                    Some(Err(s)) => {
                        let _ = events.send(Err(s.to_string()));
                        break;
                    }
                    None => {
                        let _ = events.send(Err("clean end".into()));
                        break;
                    }
                }
            }
            drop(keep); // end our side too, as the picker does
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_closes_picker_streams_cleanly_and_exits_zero() {
    let (tx, mut events) = mpsc::unbounded_channel();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(AgentIngestServer::new(Picker { events: tx }))
            .serve_with_incoming(TcpListenerStream::new(l)),
    );
    let dir = temp_dir("sigterm");
    let scenario = format!("mock:{}/scenarios/healthy.yaml", env!("CARGO_MANIFEST_DIR"));
    let cfg = write_config(&dir, &format!("http://{addr}"), &scenario);
    let mut child = Command::new(BIN)
        .arg("--config")
        .arg(&cfg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starts");
    // Snapshot received: the stream is open.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let ev = tokio::time::timeout_at(deadline, events.recv()).await.expect("stream opens").expect("open");
        if let Ok(AgentMessage { msg: Some(agent_message::Msg::Snapshot(_)) }) = ev {
            break;
        }
    }
    let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
    assert!(status.success());
    let t0 = Instant::now();
    let end = loop {
        let ev = tokio::time::timeout(Duration::from_secs(5), events.recv()).await.expect("stream ends").expect("ev");
        if let Err(e) = ev {
            break e;
        }
    };
    assert_eq!(end, "clean end", "the agent ends its report stream, not resets it");
    let code = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "agent still running 5 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(code.success(), "exit status {code}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Kills the child when dropped (a failing assertion must not leave the agent running).
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// GET `path` on a fresh connection; the status line, or why there was none within 3 s.
fn get_status(addr: std::net::SocketAddr, path: &str) -> Result<String, String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(3)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(3))).map_err(|e| e.to_string())?;
    write!(s, "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").map_err(|e| e.to_string())?;
    let mut got = String::new();
    s.read_to_string(&mut got).map_err(|e| e.to_string())?;
    got.lines().next().map(str::to_string).ok_or_else(|| "closed without an answer".into())
}

/// With the process at 512 file descriptors (a common container limit is 1024), 1 100 half-sent
/// requests would take every descriptor and leave /healthz unanswered; the listener's bound
/// closes the slow connections to serve new ones, and a half-sent request is closed after the
/// header timeout.
#[test]
fn half_sent_requests_neither_hold_sockets_nor_starve_healthz() {
    use std::io::{Read, Write};
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let dir = temp_dir("slowloris");
    let nobody = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr");
    let scenario = format!("mock:{}/scenarios/healthy.yaml", env!("CARGO_MANIFEST_DIR"));
    let cfg = dir.join("agent.yaml");
    std::fs::write(
        &cfg,
        format!(
            "pickers: [\"http://{nobody}\"]\ninsecure_ingest: true\ngpu_source: \"{scenario}\"\n\
             metrics_addr: 127.0.0.1:{port}\nmetrics_header_timeout_ms: 1000\n\
             engines:\n  - pod: engine-0\n    endpoint: {nobody}\n    model: m\n"
        ),
    )
    .expect("write config");
    let child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -n 512 && exec \"$0\" --config \"$1\"")
        .arg(BIN)
        .arg(&cfg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starts");
    let _child = KillOnDrop(child);
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    let deadline = Instant::now() + Duration::from_secs(15);
    while get_status(addr, "/livez").is_err() {
        assert!(Instant::now() < deadline, "agent never answered /healthz");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut slow = Vec::new();
    for _ in 0..1100 {
        let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else { continue };
        if s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n").is_ok() {
            slow.push(s);
        }
    }
    assert!(slow.len() > 1000, "the flood connected: {}", slow.len());
    let t = Instant::now();
    // /livez (not /healthz, which is 503 while no picker is reachable, as here).
    assert_eq!(get_status(addr, "/livez").as_deref(), Ok("HTTP/1.1 200 OK"), "livez during the flood");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    drop(slow);
    // A half-sent request is closed after metrics_header_timeout_ms (1 s), not held.
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n").expect("write");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let t = Instant::now();
    let mut buf = Vec::new();
    let closed = s.read_to_end(&mut buf).is_ok();
    assert!(closed && t.elapsed() < Duration::from_secs(4), "closed after {:?}", t.elapsed());
    let _ = std::fs::remove_dir_all(dir);
}
