//! File mode: pool and engine files re-read when edited (in place or by atomic rename), bad
//! edits keeping the last good snapshot, publishing the same snapshot types as Kubernetes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use kvroute_cluster::{watch_engine_file, watch_pool_file};

const BOUND: Duration = Duration::from_secs(2);
const POLL: Duration = Duration::from_millis(50);

/// Writes through a temporary file and a rename, as editors and ConfigMap updates do.
fn write_atomic(path: &Path, content: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, content).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test]
async fn pool_file_edits_are_followed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool.yaml");
    std::fs::write(&path, "pods: [{name: a, ip: 127.0.0.1, ports: [8000]}]\nmodels: [{name: m}]\n").unwrap();
    let (pool, models) = watch_pool_file(&path, POLL).await.unwrap();
    assert!(pool.current().synced && models.current().synced, "the first read is synchronous");
    assert_eq!(pool.current().candidates().count(), 1);

    // Add a pod (atomic rename).
    write_atomic(
        &path,
        "pods: [{name: a, ip: 127.0.0.1, ports: [8000]}, {name: b, ip: 127.0.0.1, ports: [8001]}]\nmodels: [{name: m}]\n",
    );
    pool.wait_for(BOUND, |v| v.endpoint("b-rank-0").is_some_and(|e| e.addr.port() == 8001)).await.expect("b added");

    // Unready, re-addressed, in place; and a model change.
    std::fs::write(
        &path,
        "pods: [{name: a, ip: 127.0.0.2, ports: [8000]}, {name: b, ip: 127.0.0.1, ports: [8001], ready: false}]\nmodels: [{name: m2}]\n",
    )
    .unwrap();
    let v = pool.wait_for(BOUND, |v| v.endpoint("b-rank-0").is_some_and(|e| !e.ready)).await.expect("b unready");
    assert_eq!(v.endpoint("a-rank-0").unwrap().addr.to_string(), "127.0.0.2:8000");
    models.wait_for(BOUND, |t| t.rule_for("m2").is_some() && t.rule_for("m").is_none()).await.expect("models");

    // A broken edit: the last good view stays and the error is counted.
    let generation = pool.current().generation;
    write_atomic(&path, "pods: [{name: a, ip: nope}]\n");
    let errors = || pool.stats().errors.load(std::sync::atomic::Ordering::Relaxed);
    let deadline = tokio::time::Instant::now() + BOUND;
    while errors() == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(POLL).await;
    }
    assert_eq!(errors(), 1, "{:?}", pool.stats().last_error());
    assert_eq!(pool.current().generation, generation);
    assert_eq!(pool.current().endpoints.len(), 2);

    // Fixed: followed again. Removing a pod removes its endpoint.
    write_atomic(&path, "pods: [{name: b, ip: 127.0.0.1, ports: [8001]}]\n");
    let v = pool.wait_for(BOUND, |v| v.endpoints.len() == 1).await.expect("a removed");
    assert!(v.endpoint("b-rank-0").unwrap().ready);
    assert!(v.generation > generation);
}

#[tokio::test]
async fn engine_file_edits_add_and_remove_engines() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("engines.yaml");
    std::fs::write(
        &path,
        "engines: [{pod: a, endpoint: '127.0.0.1:8000', kv_events: 'tcp://127.0.0.1:5557', gpus: [0]}]\n",
    )
    .unwrap();
    let node = watch_engine_file(&path, "host-1", POLL).await.unwrap();
    let v = node.current();
    assert_eq!(
        (v.node.as_str(), v.engines.len(), v.engines[0].kv_events.as_deref()),
        ("host-1", 1, Some("tcp://127.0.0.1:5557"))
    );

    write_atomic(
        &path,
        "engines: [{pod: a, endpoint: '127.0.0.1:8000', gpus: [0]}, {pod: b, endpoint: '127.0.0.1:8001', kv_replay: 'tcp://127.0.0.1:5560'}]\n",
    );
    let v = node.wait_for(BOUND, |v| v.engines.len() == 2).await.expect("b added");
    assert_eq!(v.engine("a-rank-0").unwrap().kv_events, None, "a's kv_events removed");
    assert_eq!(v.engine("b-rank-0").unwrap().kv_replay.as_deref(), Some("tcp://127.0.0.1:5560"));

    write_atomic(&path, "engines: [{pod: b, endpoint: '127.0.0.1:8001'}]\n");
    node.wait_for(BOUND, |v| v.engines.iter().map(|e| e.pod.as_str()).collect::<Vec<_>>() == ["b"])
        .await
        .expect("a removed");

    // A file that starts broken is a clear error at start.
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "engines: [{pod: a}]\n").unwrap();
    let err = watch_engine_file(&bad, "host-1", POLL).await.unwrap_err().to_string();
    assert!(err.contains("bad.yaml") && err.contains("endpoint"), "{err}");
    assert!(watch_engine_file(&dir.path().join("absent.yaml"), "h", POLL).await.is_err());
}
