//! Pool tests: registration, snapshot/delta application order, grace expiry, queue depth; and
//! helpers shared with the score and ingest tests.

use std::sync::Arc;
use std::time::Duration;

use kvroute_common::BlockHash;
use kvroute_proto::agent::v1::{PodInfo, PodStats};

use super::{Pool, PoolConfig, PoolUpdate, now_unix_ms};

/// Pod info for tests: endpoint derived from the name.
pub(crate) fn info(pod: &str, model: &str) -> PodInfo {
    PodInfo {
        pod: pod.into(),
        endpoint: format!("{pod}:8000"),
        model: model.into(),
        block_size: 16,
        index_block_size: 16,
        annotations: Default::default(),
    }
}

/// Ready, healthy stats observed now.
pub(crate) fn stats(gpu: f64, waiting: u32, health: f64) -> PodStats {
    PodStats {
        observed_at_unix_ms: now_unix_ms(),
        num_requests_waiting: waiting,
        gpu_utilization: gpu,
        health_score: health,
        ready: true,
        ..PodStats::default()
    }
}

/// Chain of `n` distinct test blocks starting at `base`.
pub(crate) fn chain(base: u64, n: u64) -> Vec<BlockHash> {
    (0..n).map(|i| BlockHash((base + i).wrapping_mul(0x9E37_79B9_7F4A_7C15))).collect()
}

/// Registers (or replaces) a pod with `stats` and `blocks`, and waits until it is visible.
pub(crate) async fn put(pool: &Arc<Pool>, pod: &str, model: &str, stats: PodStats, blocks: &[BlockHash]) {
    let u =
        PoolUpdate::Snapshot { stream: 1, info: info(pod, model), seq: 0, stats: Some(stats), blocks: blocks.to_vec() };
    assert!(pool.update(u).await.is_ok());
    assert!(pool.sync().await.is_ok());
}

fn small() -> Arc<Pool> {
    Pool::new(PoolConfig { grace_ttl_ms: 150, max_blocks_per_pod: 1000, ..PoolConfig::default() })
}

#[tokio::test]
async fn snapshot_registers_pod_and_blocks() {
    let pool = small();
    put(&pool, "a", "m", stats(0.5, 2, 0.9), &chain(0, 10)).await;
    let pods = pool.pods();
    assert_eq!(pods.len(), 1);
    let a = &pods[0];
    assert_eq!((a.name.as_str(), a.endpoint.as_str(), a.model.as_str()), ("a", "a:8000", "m"));
    assert!(a.connected && a.ready);
    assert_eq!((a.blocks, a.queue_depth, a.in_flight), (10, 2, 0));
    assert_eq!(pool.index_stats().entries, 10);
    // A second snapshot replaces the set.
    put(&pool, "a", "m", stats(0.5, 2, 0.9), &chain(5, 3)).await;
    assert_eq!(pool.index_stats().entries, 3);
    assert_eq!(pool.pods()[0].blocks, 3);
}

#[tokio::test]
async fn delta_applies_cleared_then_stored_then_removed() {
    let pool = small();
    put(&pool, "a", "m", stats(0.0, 0, 1.0), &chain(0, 4)).await;
    let c = chain(100, 3);
    let u = PoolUpdate::Delta {
        stream: 1,
        pod: "a".into(),
        seq: 1,
        cleared: true,
        stored: c.clone(),
        removed: vec![c[2]],
        stats: None,
    };
    assert!(pool.update(u).await.is_ok());
    assert!(pool.sync().await.is_ok());
    let snap = pool.index.load();
    assert_eq!(snap.stats().entries, 2);
    assert_eq!(snap.pods_of(c[0]).len(), 1);
    assert!(snap.pods_of(c[2]).is_empty());
    assert!(snap.pods_of(chain(0, 1)[0]).is_empty());
    // Stats were kept (delta without stats).
    assert!(pool.pods()[0].ready);
}

/// A delta that changes only a pod's blocks leaves the pod table as published (decisions read
/// the whole table; a new one is cold in their caches) and still updates the pod's block count;
/// one with stats republishes the table.
#[tokio::test]
async fn a_delta_of_blocks_alone_keeps_the_table() {
    let pool = small();
    put(&pool, "a", "m", stats(0.0, 0, 1.0), &chain(0, 4)).await;
    let delta = |stored: Vec<BlockHash>, stats: Option<PodStats>| PoolUpdate::Delta {
        stream: 1,
        pod: "a".into(),
        seq: 1,
        cleared: false,
        stored,
        removed: Vec::new(),
        stats,
    };
    let before = pool.table.load_full();
    assert!(pool.update(delta(chain(100, 3), None)).await.is_ok());
    assert!(pool.sync().await.is_ok());
    assert!(Arc::ptr_eq(&before, &pool.table.load_full()), "the table was republished for blocks alone");
    assert_eq!(pool.pods()[0].blocks, 7);
    assert!(pool.update(delta(Vec::new(), Some(stats(0.5, 3, 1.0)))).await.is_ok());
    assert!(pool.sync().await.is_ok());
    assert!(!Arc::ptr_eq(&before, &pool.table.load_full()), "new stats must reach the table");
    assert_eq!(pool.pods()[0].queue_depth, 3);
}

/// The pod table a publication patches for new stats (copying only the changed pods' chunks)
/// reads the same as one rebuilt whole, through registrations, model changes, stats and pods
/// dropped mid-table (which move the pods after them); a chunk no changed pod lies in is the
/// previous publication's, not a copy.
#[tokio::test]
async fn a_table_patched_for_new_stats_reads_as_one_rebuilt() {
    use super::{PodHot, PodTable};
    let pool = small();
    let send = |pod: usize, model: &str, gpu: f64| PoolUpdate::Snapshot {
        stream: pod as u64 + 1,
        info: info(&format!("p{pod}"), model),
        seq: 0,
        stats: Some(stats(gpu, pod as u32 % 5, 1.0)),
        blocks: Vec::new(),
    };
    let check = |table: &PodTable, step: usize| {
        let rebuilt: Vec<Arc<super::PodStatus>> = table.pods.iter().map(|p| p.status.load_full()).collect();
        assert_eq!((table.status.iter().count(), table.hot.iter().count()), (rebuilt.len(), rebuilt.len()));
        for (i, st) in rebuilt.iter().enumerate() {
            assert!(Arc::ptr_eq(&table.status[i], st), "step {step}: pod {i}'s status is not its record's");
            let (hot, want) = (format!("{:?}", table.hot[i]), format!("{:?}", PodHot::of(st)));
            assert_eq!(hot, want, "step {step}: pod {i}");
        }
        assert_eq!(*table.by_model, PodTable::group_by_model(&rebuilt), "step {step}");
    };
    for pod in 0..40 {
        assert!(pool.update(send(pod, if pod.is_multiple_of(3) { "a" } else { "b" }, 0.1)).await.is_ok());
    }
    assert!(pool.sync().await.is_ok());
    check(&pool.table.load(), 0);
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n) as usize
    };
    let mut gone = Vec::new();
    for step in 1..=60 {
        let before = pool.table.load_full();
        let live: Vec<usize> = (0..40).filter(|p| !gone.contains(p)).collect();
        let pod = live[next(live.len() as u64)];
        let model = if pod.is_multiple_of(3) { "a" } else { "b" };
        match step % 20 {
            // A pod's stream ends; the pod leaves once its grace period is over.
            10 => {
                assert!(pool.update(PoolUpdate::StreamEnded { stream: pod as u64 + 1 }).await.is_ok());
                gone.push(pod);
                let name = format!("p{pod}");
                for _ in 0..100 {
                    if !pool.table.load().pods.iter().any(|p| *p.name == *name) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            // A pod changes model.
            15 => assert!(pool.update(send(pod, if model == "a" { "c" } else { "a" }, 0.3)).await.is_ok()),
            // New stats for one pod or three.
            _ => {
                let n = if step % 2 == 0 { 1 } else { 3 };
                for _ in 0..n {
                    let p = live[next(live.len() as u64)];
                    let d = PoolUpdate::Delta {
                        stream: p as u64 + 1,
                        pod: format!("p{p}"),
                        seq: step as u64,
                        cleared: false,
                        stored: Vec::new(),
                        removed: Vec::new(),
                        stats: Some(stats(step as f64 / 100.0, step as u32, 1.0)),
                    };
                    assert!(pool.update(d).await.is_ok());
                }
            }
        }
        assert!(pool.sync().await.is_ok());
        let after = pool.table.load_full();
        check(&after, step);
        if step % 20 != 10 && step % 20 != 15 && step % 2 == 0 {
            // One pod's stats: its chunk is new, every other one shared.
            use super::column::CHUNK;
            let n = after.pods.len();
            let copied: Vec<usize> = (0..n).filter(|&i| !std::ptr::eq(&after.hot[i], &before.hot[i])).collect();
            let chunk = copied.first().map_or(usize::MAX, |i| i / CHUNK);
            assert_eq!(copied, (chunk * CHUNK..n.min(chunk * CHUNK + CHUNK)).collect::<Vec<_>>(), "step {step}");
            assert!(Arc::ptr_eq(&after.by_model, &before.by_model), "step {step}");
        }
    }
    assert_eq!(pool.table.load().pods.len(), 40 - gone.len(), "a pod whose grace period ended is still listed");
}

#[tokio::test]
async fn ended_stream_keeps_pod_for_grace_then_drops_it() {
    let pool = small();
    put(&pool, "a", "m", stats(0.0, 0, 1.0), &chain(0, 4)).await;
    assert!(pool.update(PoolUpdate::StreamEnded { stream: 1 }).await.is_ok());
    assert!(pool.sync().await.is_ok());
    let pods = pool.pods();
    assert_eq!(pods.len(), 1);
    assert!(!pods[0].connected);
    assert_eq!(pool.index_stats().entries, 4, "blocks still count during grace");
    tokio::time::sleep(Duration::from_millis(450)).await;
    assert!(pool.pods().is_empty());
    assert_eq!(pool.index_stats().entries, 0);
}

#[tokio::test]
async fn stream_end_only_disconnects_pods_it_still_owns() {
    let pool = small();
    put(&pool, "a", "m", stats(0.0, 0, 1.0), &[]).await;
    let moved = PoolUpdate::Snapshot { stream: 2, info: info("a", "m"), seq: 0, stats: None, blocks: vec![] };
    assert!(pool.update(moved).await.is_ok());
    assert!(pool.update(PoolUpdate::StreamEnded { stream: 1 }).await.is_ok());
    assert!(pool.sync().await.is_ok());
    assert!(pool.pods()[0].connected);
}

#[tokio::test]
async fn queue_depth_counts_in_flight_only_since_the_report() {
    let pool = small();
    let mut s = stats(0.0, 3, 1.0);
    s.observed_at_unix_ms = now_unix_ms() - 60_000;
    put(&pool, "a", "m", s, &[]).await;
    let rec = pool.table.load().pods[0].clone();
    rec.inflight.reserve(now_unix_ms(), 1);
    rec.inflight.reserve(now_unix_ms() - 120_000, 2); // routed before the report: engine counted it
    assert_eq!(pool.pods()[0].queue_depth, 4);
    assert_eq!(pool.pods()[0].in_flight, 2);
    // A newer report absorbs the earlier routings.
    let mut s = stats(0.0, 5, 1.0);
    s.observed_at_unix_ms = now_unix_ms() + 1000;
    put(&pool, "a", "m", s, &[]).await;
    assert_eq!(pool.pods()[0].queue_depth, 5);
}

#[test]
fn pool_works_without_an_outer_runtime() {
    let pool = Pool::new(PoolConfig::default());
    assert!(pool.pods().is_empty());
    assert_eq!(pool.index_stats().nodes, 0);
}

/// A synced pool view with `pods` as `(name, ip, ready)`, one target port 8000 (endpoints
/// `<name>-rank-0`).
pub(crate) fn view(pods: &[(&str, &str, bool)]) -> Arc<kvroute_cluster::PoolView> {
    use kvroute_cluster::{PoolPod, PoolSpecView, PoolView, Source};
    let spec = PoolSpecView { target_ports: vec![8000], app_protocol: "http".into(), ..Default::default() };
    let pods = pods.iter().map(|(name, ip, ready)| PoolPod {
        name: (*name).into(),
        namespace: "ns".into(),
        uid: None,
        node: Some("node-1".into()),
        ip: ip.parse().ok(),
        ready: *ready,
        terminating: false,
        ports: vec![(0, 8000)],
        labels: Default::default(),
        annotations: Default::default(),
    });
    Arc::new(PoolView::build(Source::File("pool.yaml".into()), Some(spec), pods, true))
}

fn endpoints(pool: &Pool) -> Vec<(String, String)> {
    let mut v: Vec<_> = pool.pods().into_iter().map(|p| (p.name, p.endpoint)).collect();
    v.sort();
    v
}

#[tokio::test]
async fn pool_view_is_the_only_source_of_pods_and_addresses() {
    let pool = small();
    // An agent-registered pod from before the pool source is not the pool's.
    put(&pool, "stray", "m", stats(0.1, 0, 1.0), &chain(0, 3)).await;
    pool.set_membership(view(&[("a", "10.0.0.1", true), ("b", "10.0.0.2", false)])).await.unwrap();
    assert_eq!(
        endpoints(&pool),
        [("a-rank-0".into(), "10.0.0.1:8000".into()), ("b-rank-0".into(), "10.0.0.2:8000".into())]
    );
    assert!(pool.admits("a-rank-0") && pool.admits("b-rank-0") && !pool.admits("stray"));
    // A report for a member keeps the pool's address, whatever the report says.
    put(&pool, "a-rank-0", "m", stats(0.2, 1, 0.9), &chain(10, 4)).await;
    let a = pool.pods().into_iter().find(|p| p.name == "a-rank-0").unwrap();
    assert_eq!((a.endpoint.as_str(), a.model.as_str(), a.blocks), ("10.0.0.1:8000", "m", 4));
    // A report for a non-member changes nothing (the writer ignores it even if ingest let it by).
    put(&pool, "intruder-rank-0", "m", stats(0.0, 0, 1.0), &chain(20, 4)).await;
    assert_eq!(pool.pods().len(), 2);
    assert_eq!(pool.agent_coverage().map(|c| (c.share(), c.ready_endpoints)), Some((1.0, 1)));
    // Re-addressed, unready → ready, deleted: applied at once, no restart.
    pool.set_membership(view(&[("a", "10.0.0.9", true), ("b", "10.0.0.2", true)])).await.unwrap();
    assert_eq!(endpoints(&pool)[0], ("a-rank-0".into(), "10.0.0.9:8000".into()));
    assert_eq!(pool.agent_coverage().map(|c| (c.share(), c.ready_endpoints)), Some((0.5, 2)));
    pool.set_membership(view(&[("b", "10.0.0.2", true)])).await.unwrap();
    assert_eq!(endpoints(&pool), [("b-rank-0".into(), "10.0.0.2:8000".into())]);
    assert!(!pool.admits("a-rank-0"));
    assert_eq!(pool.index_stats().entries, 0, "the deleted pod's blocks left the index");
}

#[tokio::test]
async fn a_view_not_yet_applied_is_not_full_coverage() {
    let pool = small();
    // The view as `set_membership` stores it, before the writer has applied it to the table.
    pool.membership.store(Some(view(&[("a", "10.0.0.1", true), ("b", "10.0.0.2", true)])));
    let c = pool.agent_coverage().unwrap();
    assert_eq!((c.share(), c.ready_endpoints, c.engines_ready), (0.0, 2, 0), "no agent has reported on a or b");
    assert!(c.any_routable(), "endpoints no agent reports on are routed by load");
}

#[tokio::test]
async fn expired_agent_state_of_a_member_is_dropped_but_the_member_stays() {
    let pool = small();
    pool.set_membership(view(&[("a", "10.0.0.1", true)])).await.unwrap();
    put(&pool, "a-rank-0", "m", stats(0.2, 1, 0.9), &chain(0, 4)).await;
    assert!(pool.update(PoolUpdate::StreamEnded { stream: 1 }).await.is_ok());
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(pool.sync().await.is_ok());
    let pods = pool.pods();
    assert_eq!(pods.len(), 1, "still in the pool");
    assert_eq!((pods[0].blocks, pods[0].connected, pods[0].ready), (0, false, false));
    assert_eq!(
        (pods[0].health_score, pods[0].health_reason.as_str()),
        (super::NO_REPORT_HEALTH, super::NO_REPORT_REASON)
    );
    assert_eq!(pool.agent_coverage().map(|c| (c.share(), c.ready_endpoints)), Some((0.0, 1)));
}

#[tokio::test]
async fn a_silent_agents_stats_count_as_unknown_after_the_report_age() {
    let pool = Pool::new(PoolConfig { max_report_age_ms: 200, ..PoolConfig::default() });
    let mut s = stats(0.0, 1, 1.0);
    s.observed_at_unix_ms = now_unix_ms() - 60_000;
    put(&pool, "a", "m", s.clone(), &[]).await;
    let rec = pool.table.load().pods[0].clone();
    rec.inflight.reserve(now_unix_ms() - 120_000, 1); // before the report: counted by the engine
    let fresh = &pool.pods()[0];
    assert_eq!((fresh.health_score, fresh.queue_depth, fresh.report_stale), (1.0, 1, false));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stale = &pool.pods()[0];
    assert!(stale.report_stale);
    assert_eq!(stale.health_score, super::STALE_REPORT_HEALTH, "a silent agent's pod is not perfectly healthy");
    assert_eq!(stale.health_reason, super::STALE_REPORT_REASON);
    assert_eq!(stale.queue_depth, 2, "every in-flight request counts once the report is stale");
    // A report (even with the same figures) makes it fresh again.
    put(&pool, "a", "m", s, &[]).await;
    let back = &pool.pods()[0];
    assert_eq!((back.health_score, back.queue_depth, back.report_stale), (1.0, 1, false));
}

/// The probe wants an HTTP answer, not just a connect: a frozen engine's kernel still completes
/// the handshake of its listening socket.
#[tokio::test]
async fn an_unreachable_pod_returns_when_its_endpoint_answers_http() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let pool = small();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut i = info("a", "m");
    i.endpoint = addr.to_string();
    let u = PoolUpdate::Snapshot { stream: 1, info: i, seq: 0, stats: Some(stats(0.0, 0, 1.0)), blocks: vec![] };
    assert!(pool.update(u).await.is_ok());
    assert!(pool.sync().await.is_ok());
    assert!(!pool.mark_unreachable("nobody"));
    assert!(pool.mark_unreachable("a"));
    assert!(pool.pods()[0].unreachable);
    // Bound, never accepting or answering (a SIGSTOPped engine): the mark stays.
    assert_eq!(pool.probe_unreachable(Duration::from_millis(200)).await, 1);
    assert!(pool.pods()[0].unreachable, "a connect without an answer keeps the mark");
    drop(listener);
    // Nothing listens: the mark stays.
    assert_eq!(pool.probe_unreachable(Duration::from_millis(200)).await, 1);
    assert!(pool.pods()[0].unreachable);
    // An HTTP server answering (any status): the mark clears.
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let mut buf = [0u8; 256];
            let _ = s.read(&mut buf).await;
            let _ = s.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n").await;
        }
    });
    assert_eq!(pool.probe_unreachable(Duration::from_millis(200)).await, 1);
    assert!(!pool.pods()[0].unreachable, "an HTTP answer clears the mark");
    assert_eq!(pool.probe_unreachable(Duration::from_millis(200)).await, 0);
}

/// An agent hashing blocks of another size than the index's (misconfigured `index_block_size`, or
/// an older agent whose engine blocks differ) has its blocks left out of the index, never mixed
/// in: the pod stays a candidate by load. An engine block size that differs is fine as long as
/// the agent hashes at the index's granularity.
#[tokio::test]
async fn blocks_of_another_granularity_are_not_indexed() {
    let pool = small();
    let snapshot = |pod: &str, block_size, index_block_size| PoolUpdate::Snapshot {
        stream: 1,
        info: PodInfo { block_size, index_block_size, ..info(pod, "m") },
        seq: 0,
        stats: Some(stats(0.0, 0, 1.0)),
        blocks: chain(0, 4),
    };
    for u in [snapshot("engine-32", 32, 16), snapshot("agent-32", 32, 32), snapshot("old-agent-32", 32, 0)] {
        assert!(pool.update(u).await.is_ok());
    }
    assert!(pool.sync().await.is_ok());
    let blocks = |name: &str| pool.pods().iter().find(|p| p.name == name).map(|p| p.blocks);
    assert_eq!(blocks("engine-32"), Some(4));
    assert_eq!(blocks("agent-32"), Some(0));
    assert_eq!(blocks("old-agent-32"), Some(0));
    assert_eq!(pool.index_stats().entries, 4);
    // Deltas of such a pod are refused too.
    let u = PoolUpdate::Delta {
        stream: 1,
        pod: "agent-32".into(),
        seq: 1,
        cleared: false,
        stored: chain(50, 2),
        removed: Vec::new(),
        stats: None,
    };
    assert!(pool.update(u).await.is_ok());
    assert!(pool.sync().await.is_ok());
    assert_eq!(blocks("agent-32"), Some(0));
}

/// Readiness follows the engines (docs/design.md §14): an agent's report of an engine that does
/// not answer yet covers nothing, and a pool whose every Ready endpoint is such an engine has no
/// routable endpoint; an endpoint no agent reports on may still be routed by load.
#[tokio::test]
async fn coverage_counts_engines_that_answer() {
    let pool = small();
    pool.set_membership(view(&[("a", "10.0.0.1", true), ("b", "10.0.0.2", true)])).await.unwrap();
    let c = pool.agent_coverage().unwrap();
    assert_eq!((c.share(), c.any_routable()), (0.0, true), "no agent yet: routed by load");
    let starting = PodStats { ready: false, ..stats(0.0, 0, 0.0) };
    put(&pool, "a-rank-0", "m", starting.clone(), &[]).await;
    put(&pool, "b-rank-0", "m", starting, &[]).await;
    let c = pool.agent_coverage().unwrap();
    assert_eq!((c.ready_endpoints, c.engines_ready, c.engines_unready), (2, 0, 2));
    assert_eq!((c.share(), c.any_routable()), (0.0, false), "every engine still starting");
    put(&pool, "a-rank-0", "m", stats(0.0, 0, 1.0), &[]).await;
    let c = pool.agent_coverage().unwrap();
    assert_eq!((c.share(), c.any_routable()), (0.5, true));
}

/// A report exactly `max_age` old is still fresh and one a nanosecond older is stale, with the
/// cutoff a decision computes once as with the duration per pod; a limit reaching before any
/// instant makes nothing stale.
#[tokio::test]
async fn a_reports_age_is_judged_the_same_by_cutoff_and_by_duration() {
    let pool = Pool::new(PoolConfig::default());
    put(&pool, "a", "m", stats(0.0, 1, 1.0), &[]).await;
    let status = pool.table.load().status[0].clone();
    let at = status.stats_at.expect("a report was received");
    let max_age = Duration::from_millis(500);
    for (now, stale) in [(at + max_age, false), (at + max_age + Duration::from_nanos(1), true), (at, false)] {
        assert_eq!(status.report_stale(now, max_age), stale, "{:?} after the report", now - at);
        assert_eq!(status.report_stale_before(super::stale_before(now, max_age)), stale);
    }
    let later = at + Duration::from_secs(3600);
    assert_eq!(super::stale_before(later, Duration::MAX), None, "before any instant");
    for forever in [Duration::MAX, Duration::from_secs(u64::MAX / 4)] {
        assert!(!status.report_stale(later, forever));
        assert!(!status.report_stale_before(super::stale_before(later, forever)));
    }
}
