//! The ext_proc listener under a flood of half-open connections (docs/decisions/0042-bounded-ext-proc-listener.md),
//! the 20,000-socket attack scaled down: the picker binary runs with 1,024 file descriptors and an
//! ext_proc cap of 500, and 2,000 sockets send part of the HTTP/2 preface and stall. The admin
//! port, agent ingest and the pool-file watcher keep working; every stalled socket is closed (at
//! accept past the cap, else at the first-stream deadline); a new ext_proc connection works once
//! they are gone; the picker's RSS returns to within 20 % of what it was before the flood. A
//! second test checks the first-stream deadline and the idle limit in-process.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvroute_harness::fake_agent::{FakeAgent, FakePod};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const SOCKETS: usize = 2_000;
const CAP: usize = 500;
const FD_LIMIT: u64 = 1_024;
const FIRST_STREAM_MS: u64 = 8_000;

struct Picker(Child);
impl Drop for Picker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn tokenizer_dir() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer-qwen2.5").display().to_string()
}

fn pool_file(path: &Path, pods: &[(&str, u16)]) {
    let list: Vec<String> = pods
        .iter()
        .map(|(name, port)| format!("{{name: {name}, ip: 127.0.0.1, node: fake-node, ports: [{port}]}}"))
        .collect();
    std::fs::write(path, format!("pods: [{}]\n", list.join(", "))).unwrap();
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

async fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").as_bytes()).await?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await??;
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    Ok((status, text))
}

/// A gauge's value in the admin port's `/metrics`.
async fn gauge(admin: SocketAddr, name: &str) -> Option<f64> {
    let (_, text) = get(admin, "/metrics").await.ok()?;
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// One gRPC health check on the ext_proc port (a new connection).
async fn ext_proc_answers(addr: SocketAddr) -> bool {
    let check = async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).ok()?.connect().await.ok()?;
        let mut client = tonic_health::pb::health_client::HealthClient::new(channel);
        client.check(tonic_health::pb::HealthCheckRequest { service: String::new() }).await.ok()
    };
    matches!(tokio::time::timeout(Duration::from_secs(3), check).await, Ok(Some(_)))
}

/// Reads until the peer closes; when it closed (None past `within`).
async fn closed_at(mut s: TcpStream, within: Duration) -> Option<Instant> {
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => return Some(Instant::now()),
            Ok(Ok(_)) => {}
            Err(_) => return None,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_flood_leaves_admin_ingest_and_watcher_working() {
    let nofile = kvroute_picker::limits::raise_nofile_limit();
    let sockets = SOCKETS.min(usize::try_from(nofile.saturating_sub(200)).unwrap_or(SOCKETS));
    assert!(sockets > CAP * 2, "the test process needs {} descriptors, has {nofile}", CAP * 2 + 200);
    let port = || kvroute_harness::paths::free_port().unwrap();
    let (ext, ingest, admin) = (port(), port(), port());
    let dir = tempfile::tempdir().unwrap();
    let pool = dir.path().join("pool.yaml");
    pool_file(&pool, &[("p", 8000), ("q", 8001)]);
    let config = dir.path().join("picker.yaml");
    std::fs::write(
        &config,
        format!(
            "ext_proc_addr: 127.0.0.1:{ext}\ningest_addr: 127.0.0.1:{ingest}\ninsecure_ingest: true\n\
             admin_addr: 127.0.0.1:{admin}\npool_file: pool.yaml\nmodels:\n  - name: m\n    tokenizer: {}\n\
             limits: {{ext_proc_max_connections: {CAP}, ext_proc_first_stream_ms: {FIRST_STREAM_MS}}}\n",
            tokenizer_dir()
        ),
    )
    .unwrap();
    // The picker raises its soft limit to the hard one: `ulimit -n` lowers both.
    let mut child = Command::new("sh")
        .args(["-c", &format!("ulimit -n {FD_LIMIT} && exec \"$0\" \"$@\"")])
        .arg(env!("CARGO_BIN_EXE_kvroute-picker"))
        .args(["--config", config.to_str().unwrap(), "--log-level", "warn"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let picker = Picker(child);
    let pid = picker.0.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    assert_eq!(rx.recv_timeout(Duration::from_secs(60)).unwrap().trim(), "READY");
    let local = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
    let (ext, ingest, admin) = (local(ext), local(ingest), local(admin));

    let pods = [FakePod::new("p-rank-0", "127.0.0.1:8000", "m"), FakePod::new("q-rank-0", "127.0.0.1:8001", "m")];
    let _agent = FakeAgent::connect(ingest, &pods).await.unwrap();
    let mut routable = None;
    for _ in 0..200 {
        routable = gauge(admin, "epp_pool_routable_pods").await;
        if routable == Some(2.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if routable != Some(2.0) {
        let (_, m) = get(admin, "/metrics").await.unwrap();
        eprintln!("{}", m.lines().filter(|l| l.contains("pool") || l.contains("refus")).collect::<Vec<_>>().join("\n"));
    }
    assert_eq!(routable, Some(2.0), "both pods routable before the flood");
    for _ in 0..20 {
        assert!(ext_proc_answers(ext).await, "ext_proc health before the flood");
    }
    // Baseline: the lowest RSS over 2 s after start-up.
    let mut baseline = rss_kib(pid);
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        baseline = baseline.min(rss_kib(pid));
    }

    // The flood: half the sockets send 16 of the preface's 24 bytes and stall, half the whole
    // preface and an empty SETTINGS frame (the server sets up its HTTP/2 state) and stall.
    let started = Instant::now();
    let mut open = Vec::with_capacity(sockets);
    let mut connect_failed = 0;
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";
    for i in 0..sockets {
        match TcpStream::connect(ext).await {
            Ok(mut s) => {
                let _ = s.write_all(if i % 2 == 0 { &PREFACE[..16] } else { PREFACE }).await;
                open.push(s);
            }
            Err(_) => connect_failed += 1,
        }
    }
    let flooded_in = started.elapsed();
    let peak = rss_kib(pid);
    let waiters: Vec<_> = open
        .into_iter()
        .map(|s| tokio::spawn(closed_at(s, Duration::from_millis(FIRST_STREAM_MS) + Duration::from_secs(10))))
        .collect();

    // Under the flood: admin answers, an agent connects and reports, the pool file is followed.
    let t = Instant::now();
    let (status, _) = get(admin, "/healthz").await.expect("admin answers under the flood");
    assert_eq!(status, 200);
    let healthz_took = t.elapsed();
    let t = Instant::now();
    let _agent2 = FakeAgent::connect(ingest, &pods[..1]).await.expect("ingest answers under the flood");
    let ingest_took = t.elapsed();
    pool_file(&pool, &[("p", 8000)]);
    let mut followed = false;
    for _ in 0..200 {
        if gauge(admin, "epp_pool_routable_pods").await == Some(1.0) {
            followed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(followed, "the pool-file watcher followed a change under the flood");
    assert!(started.elapsed() < Duration::from_millis(FIRST_STREAM_MS), "checks ran while the flood was open");

    let during = rss_kib(pid);
    let mut still_open = 0;
    let (mut at_accept, mut at_deadline) = (0, 0);
    for w in waiters {
        match w.await.unwrap() {
            None => still_open += 1,
            Some(at) if at.duration_since(started) < Duration::from_millis(FIRST_STREAM_MS / 2) => at_accept += 1,
            Some(_) => at_deadline += 1,
        }
    }
    let all_closed_in = started.elapsed();
    assert_eq!(still_open, 0, "half-open ext_proc connections outlived the first-stream deadline");
    assert!(at_deadline <= CAP, "{at_deadline} connections were held open, cap {CAP}");
    assert!(at_accept >= sockets - connect_failed - CAP, "{at_accept} closed at accept");
    assert!(ext_proc_answers(ext).await, "ext_proc takes a new connection after the flood");

    // Against the lowest RSS seen, before or during the flood (mimalloc returns start-up's
    // transient allocations some time after READY, here during the flood): the flood's own
    // memory must be gone.
    let reference = baseline.min(peak);
    let mut after = rss_kib(pid);
    for _ in 0..100 {
        if after * 5 <= reference * 6 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        after = rss_kib(pid);
    }
    eprintln!(
        "ext_proc flood: {sockets} half-open sockets (partial preface or preface + SETTINGS) (cap {CAP}, {FD_LIMIT} fds) opened in {flooded_in:?} \
         ({connect_failed} connects failed); {at_accept} closed at accept, {at_deadline} at the {FIRST_STREAM_MS} ms \
         deadline, all closed after {all_closed_in:?}; /healthz {healthz_took:?}, ingest {ingest_took:?}; \
         RSS {baseline} KiB before, {peak} KiB when the flood opened, {during} KiB at its end, {after} KiB after"
    );
    assert!(
        after * 5 <= reference * 6,
        "RSS {after} KiB after the flood, lowest before or during it {reference} KiB (> +20 %)"
    );
}

/// The first-stream deadline and the idle limit, in-process: a silent connection closes at
/// `ext_proc_first_stream_ms`; a client whose only stream ended closes at `ext_proc_idle_ms`; a
/// connection with a stream open stays however long the stream lasts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_stream_deadline_and_idle_limit() {
    use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
    use std::sync::atomic::Ordering;
    let config = kvroute_picker::config::PickerConfig::from_yaml(
        "ext_proc_addr: 127.0.0.1:0\ningest_addr: 127.0.0.1:0\ninsecure_ingest: true\nadmin_addr: 127.0.0.1:0\n\
         models: [{name: m}]\nlimits: {ext_proc_first_stream_ms: 400, ext_proc_idle_ms: 400, body_timeout_ms: 60000}\n",
    )
    .unwrap();
    let picker = kvroute_picker::start(&config).await.unwrap();
    let counters = picker.ext_proc_connections.clone();
    let open = || counters.open.load(Ordering::Relaxed);

    // Silent: closed at the first-stream deadline.
    let t = Instant::now();
    let silent = TcpStream::connect(picker.ext_proc_addr).await.unwrap();
    let closed = closed_at(silent, Duration::from_secs(5)).await.expect("a silent connection is closed");
    let silent_took = closed.duration_since(t);
    assert!(silent_took >= Duration::from_millis(350) && silent_took < Duration::from_secs(4), "{silent_took:?}");

    // One stream held open for 1.2 s (3 × the idle limit): the connection stays.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", picker.ext_proc_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel::<ProcessingRequest>(1);
    let mut stream = ExternalProcessorClient::new(channel.clone())
        .process(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(open(), 1, "a connection with an open stream is not idle");
    // The stream ends: the connection closes at the idle limit.
    drop(tx);
    while let Ok(Some(_)) = stream.message().await {}
    let t = Instant::now();
    while open() > 0 {
        assert!(t.elapsed() < Duration::from_secs(4), "the idle connection stayed open");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let idle_took = t.elapsed();
    assert!(counters.timed_out.load(Ordering::Relaxed) >= 2, "both closed by a deadline");
    eprintln!(
        "ext_proc deadlines (400 ms each): silent connection closed after {silent_took:?}, idle one {idle_took:?} after its stream ended"
    );
    picker.shutdown();
}
