//! GIE's `EndpointPickerConfig` read by the picker's config loader (fixtures in
//! tests/fixtures/gie, taken from GIE's and llm-d's own configs), and the binary started the way
//! GIE's inferencepool Helm chart starts its EPP: the chart's args, its probes' gRPC health
//! service on the health port, TLS on ext_proc.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvroute_picker::config::ConfigError;
use kvroute_picker::gie::load_with;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gie").join(name)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn gie_chart_default_plugins_map_onto_the_weights() {
    let (c, warnings) = load_with(None, Some(&fixture("default-plugins.yaml"))).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    // queue 2, kv-cache-utilization 2, prefix 3 (of 7) share what kvroute's health leaves.
    let w = c.scoring.weights;
    let share = 1.0 - w.health;
    assert!(w.health > 0.0, "kvroute keeps its health term");
    assert!(close(w.cache, 3.0 / 7.0 * share), "{w:?}");
    assert!(close(w.load, 2.0 / 7.0 * share) && close(w.queue, 2.0 / 7.0 * share), "{w:?}");
    assert!(close(w.adapter, 0.0), "{w:?}");
    assert!(close(w.cache + w.load + w.queue + w.health + w.adapter, 1.0));
    // Started GIE's way: GIE's ports on all interfaces, the ingest beside them.
    assert_eq!(c.ext_proc_addr, "0.0.0.0:9002".parse().unwrap());
    assert_eq!(c.health_addr(), "0.0.0.0:9003".parse().unwrap());
    assert_eq!(c.admin_addr, "0.0.0.0:9090".parse().unwrap());
    assert_eq!(c.ingest_addr, "0.0.0.0:9004".parse().unwrap());
    c.validate().unwrap();
}

#[test]
fn llm_d_precise_config_maps_and_says_what_is_not_applied() {
    let (c, warnings) = load_with(None, Some(&fixture("llm-d-precise-prefix.yaml"))).unwrap();
    let w = c.scoring.weights;
    assert!(close(w.cache, 1.0 - w.health) && close(w.load + w.queue + w.adapter, 0.0), "{w:?}");
    let all = warnings.join("\n");
    assert!(all.contains("decode-filter") && all.contains("filters are not applied"), "{all}");
    assert!(all.contains("precise-prefix-cache-scorer") && all.contains("indexerConfig"), "{all}");
    assert_eq!(warnings.len(), 2, "max-score-picker and single-profile-handler are what kvroute does: {all}");
}

#[test]
fn two_profiles_and_unknown_plugins_are_refused_by_name() {
    let err = load_with(None, Some(&fixture("pd-two-profiles.yaml"))).unwrap_err().to_string();
    assert!(err.contains("schedulingProfiles") && err.contains("prefill") && err.contains("one"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let head = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n";
    for (text, needles) in [
        ("plugins: [{type: fancy-scorer}]\n", &["fancy-scorer", "queue-scorer"][..]),
        ("plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: d, plugins: [{pluginRef: nope}]}]\n", &["nope"]),
        (
            "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: d, plugins: [{pluginRef: queue-scorer, weight: -1}]}]\n",
            &["weight", "-1"],
        ),
        ("plugins: [{type: queue-scorer}, {type: queue-scorer}]\n", &["twice"]),
        ("plugins: []\nbogus: 1\n", &["bogus"]),
    ] {
        let err = load_with(None, Some(&write("c.yaml", &format!("{head}{text}")))).unwrap_err().to_string();
        assert!(needles.iter().all(|n| err.contains(n)), "{text}: {err}");
    }
    let err = load_with(None, Some(&write("v.yaml", "apiVersion: v9\nkind: EndpointPickerConfig\nplugins: []\n")))
        .unwrap_err();
    assert!(matches!(err, ConfigError::Invalid(ref f) if f.field == "apiVersion"), "{err}");
    // A weight on a plugin that is no mapped scorer is reported, not silently used.
    let (_, warnings) = load_with(
        None,
        Some(&write(
            "w.yaml",
            &format!(
                "{head}plugins: [{{type: queue-scorer}}, {{type: max-score-picker}}]\n\
                 schedulingProfiles: [{{name: d, plugins: [{{pluginRef: queue-scorer}}, {{pluginRef: max-score-picker, weight: 3}}]}}]\n"
            ),
        )),
    )
    .unwrap();
    assert!(warnings.iter().any(|w| w.contains("max-score-picker") && w.contains("ignored")), "{warnings:?}");
}

#[test]
fn kvroute_settings_ride_in_the_plugins_config_or_in_config_not_both() {
    let (c, _) = load_with(None, Some(&fixture("kvroute-plugin.yaml"))).unwrap();
    assert!(c.insecure_ingest && c.ready_timeout_ms == 200 && c.models.len() == 1);
    assert_eq!(c.ext_proc_addr, "0.0.0.0:9002".parse().unwrap(), "listeners not named: GIE's");
    let w = c.scoring.weights;
    // queue 1, load 1, cache 2, adapter 1 (the default weight) of 5.
    assert!(close(w.adapter, 0.2 * (1.0 - w.health)) && close(w.cache, 0.4 * (1.0 - w.health)), "{w:?}");
    let dir = tempfile::tempdir().unwrap();
    let own = dir.path().join("picker.yaml");
    std::fs::write(&own, "pool_file: pool.yaml\nscoring: {preset: batch}\n").unwrap();
    let err = load_with(Some(&own), Some(&fixture("kvroute-plugin.yaml"))).unwrap_err().to_string();
    assert!(err.contains("kvroute-picker") && err.contains("one place"), "{err}");
    // --config beside a GIE file: kvroute's file is the base, the profile's weights go over it.
    let (c, _) = load_with(Some(&own), Some(&fixture("default-plugins.yaml"))).unwrap();
    assert_eq!(c.pool_file.as_deref(), Some(dir.path().join("pool.yaml").as_path()));
    assert_eq!(c.ext_proc_addr, "127.0.0.1:9002".parse().unwrap(), "kvroute's file keeps its own defaults");
    assert!(close(c.scoring.weights.cache, 3.0 / 7.0 * (1.0 - c.scoring.weights.health)));
    // A kvroute picker config passed the GIE way (--config-file) is read as one.
    let (c, _) = load_with(None, Some(&own)).unwrap();
    assert_eq!(c.pool_file.as_deref(), Some(dir.path().join("pool.yaml").as_path()));
}

/// GIE's flags as its chart and users pass them: accepted with GIE's meaning, bad values refused
/// with exit code 2 naming the flag.
#[test]
fn gie_flags_are_accepted_and_checked() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_kvroute-picker")).args(args).output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
    };
    let config = fixture("default-plugins.yaml");
    let config = config.to_str().unwrap();
    let ok = [
        "--pool-name",
        "p",
        "--pool-namespace",
        "ns",
        "--config-file",
        config,
        "--zap-encoder",
        "json",
        "--zap-log-level",
        "error",
        "-v",
        "3",
        "--grpc-port",
        "19002",
        "--grpc-health-port",
        "19003",
        "--metrics-port",
        "19090",
        "--secure-serving=false",
        "--check-config",
    ];
    let (code, out) = run(&ok);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("config OK"), "{out}");
    for (bad, needle) in [
        (&["--pool-name", "p", "--pool-group", "inference.networking.x-k8s.io", "--check-config"][..], "--pool-group"),
        (&["--pool-name", "p", "--grpc-port", "9002", "--grpc-health-port", "9002", "--check-config"], "health_addr"),
        (&["--pool-name", "p", "--zap-encoder", "xml", "--check-config"], "zap-encoder"),
        (&["--check-config"], "--pool-name"),
    ] {
        let (code, out) = run(bad);
        assert_eq!(code, Some(2), "{bad:?}: {out}");
        assert!(out.contains(needle), "{bad:?}: {out}");
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The binary with the args GIE's chart passes its EPP (image and plugins config changed only),
/// ports moved off the defaults so that tests can run side by side.
#[tokio::test]
async fn the_binary_starts_with_the_gie_charts_args_and_answers_its_probes() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("plugins.yaml");
    let text = std::fs::read_to_string(fixture("kvroute-plugin.yaml")).unwrap().replace(
        "    models: [{name: m}]\n",
        "    models: [{name: m}]\n    pool_file: pool.yaml\n    ingest_addr: 127.0.0.1:0\n",
    );
    std::fs::write(&config, text).unwrap();
    std::fs::write(dir.path().join("pool.yaml"), "pods: [{name: p, ip: 127.0.0.1, ports: [8000]}]\n").unwrap();
    let (grpc, health, metrics) = (free_port(), free_port(), free_port());
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute-picker"))
        .args(["--zap-encoder", "json", "--log-level", "error", "--config-file"])
        .arg(&config)
        .args(["--grpc-port", &grpc.to_string(), "--grpc-health-port", &health.to_string()])
        .args(["--metrics-port", &metrics.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let stdout = child.stdout.take().unwrap();
    let _child = Kill(child);
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        line
    });
    let line = tokio::time::timeout(Duration::from_secs(60), line).await.unwrap().unwrap();
    assert_eq!(line.trim(), "READY");
    // The chart's probes: grpc.health.v1 on the health port, service `inference-extension`
    // (`liveness` / `readiness` with leader election), plaintext.
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{health}")).unwrap().connect().await.unwrap();
    let mut client = tonic_health::pb::health_client::HealthClient::new(channel);
    let check = |service: &str| tonic_health::pb::HealthCheckRequest { service: service.into() };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status = client.check(check("inference-extension")).await.unwrap().into_inner().status;
        if status == tonic_health::pb::health_check_response::ServingStatus::Serving as i32 {
            break;
        }
        assert!(Instant::now() < deadline, "not SERVING within 30 s: {status}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for service in ["", "liveness", "readiness"] {
        let status = client.check(check(service)).await.unwrap().into_inner().status;
        assert_eq!(status, tonic_health::pb::health_check_response::ServingStatus::Serving as i32, "{service:?}");
    }
    // ext_proc is TLS, as GIE's EPP serves it by default (--secure-serving): plaintext fails.
    let plain = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{grpc}")).unwrap().connect().await;
    let refused = match plain {
        Err(_) => true,
        Ok(ch) => tonic_health::pb::health_client::HealthClient::new(ch).check(check("")).await.is_err(),
    };
    assert!(refused, "ext_proc answered plaintext");
    // Metrics on the metrics port.
    let body = reqwest_like_get(metrics, "/metrics").await;
    assert!(body.contains("inference_pool_ready_pods"), "{body}");
    assert!(Path::new(&config).exists());
}

/// A plain HTTP/1.1 GET (the admin listener), body returned.
async fn reqwest_like_get(port: u16, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}
