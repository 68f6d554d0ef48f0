//! The API stand-in's wire format against responses recorded from real API servers
//! (`tests/fixtures/kube-apiserver`): the same requests, replayed against the stand-in holding the
//! same objects, must produce the same shapes, and kube-rs must read them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::PathBuf;

use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use k8s_openapi::api::core::v1::Pod;
use kube::core::{ObjectList, WatchEvent};
use kvroute_kube_stand_in::{ApiServer, ResourceType};
use serde_json::Value;

/// One recorded exchange.
#[derive(serde::Deserialize)]
struct Exchange {
    request_url: String,
    request_method: String,
    response_status_code: u16,
    response_body: String,
}

fn fixture(name: &str) -> Vec<Exchange> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/kube-apiserver").join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

async fn get(server: &ApiServer, url: &str) -> (StatusCode, String) {
    let client = server.client("default").unwrap();
    let req = Request::get(url).body(kube::client::Body::empty()).unwrap();
    let resp = client.send(req).await.unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object().map(|m| m.keys().cloned().collect()).unwrap_or_default()
}

/// The object minus what the store assigns on creation.
fn without_server_fields(mut v: Value) -> Value {
    if let Some(m) = v["metadata"].as_object_mut() {
        for k in ["resourceVersion", "uid", "creationTimestamp", "generation"] {
            m.remove(k);
        }
    }
    v
}

fn lines(body: &str) -> Vec<Value> {
    body.lines().filter(|l| !l.trim().is_empty()).map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// Loads the recorded pods (raw JSON, not through a typed struct, so nothing is lost).
async fn server_with_recorded_pods() -> (ApiServer, Vec<Value>) {
    let recorded = &fixture("pod-list.json")[0];
    let list: Value = serde_json::from_str(&recorded.response_body).unwrap();
    let items = list["items"].as_array().unwrap().clone();
    let server = ApiServer::start().await.unwrap();
    let pods = ResourceType::of::<Pod>();
    for item in &items {
        server.store().create(&pods, None, item.clone()).unwrap();
    }
    (server, items)
}

#[tokio::test]
async fn pod_list_matches_the_recorded_list() {
    let recorded = &fixture("pod-list.json")[0];
    assert_eq!(recorded.request_method, "GET");
    let want: Value = serde_json::from_str(&recorded.response_body).unwrap();
    let (server, _) = server_with_recorded_pods().await;

    let (status, body) = get(&server, &recorded.request_url).await;
    assert_eq!(status.as_u16(), recorded.response_status_code);
    let got: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(keys(&got), keys(&want), "list envelope");
    assert_eq!(got["kind"], want["kind"]);
    assert_eq!(got["apiVersion"], want["apiVersion"]);
    assert_eq!(keys(&got["metadata"]), keys(&want["metadata"]), "no continue on a complete built-in list");
    let (g, w) = (got["items"].as_array().unwrap(), want["items"].as_array().unwrap());
    assert_eq!(g.len(), w.len());
    for (g, w) in g.iter().zip(w) {
        assert_eq!(keys(g), keys(w), "built-in list items carry no kind/apiVersion");
        assert_eq!(without_server_fields(g.clone()), without_server_fields(w.clone()));
    }
    // And kube-rs reads both.
    let theirs: ObjectList<Pod> = serde_json::from_str(&recorded.response_body).unwrap();
    let ours: ObjectList<Pod> = serde_json::from_str(&body).unwrap();
    assert_eq!(
        theirs.items.iter().map(|p| p.metadata.name.clone()).collect::<Vec<_>>(),
        ours.items.iter().map(|p| p.metadata.name.clone()).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn streaming_list_matches_the_recorded_watch() {
    let recorded = &fixture("watch_event-watch_pods_without_initial_events.json")[0];
    let want = lines(&recorded.response_body);
    let (server, _) = server_with_recorded_pods().await;
    // Bound the stream: the stand-in closes it after one second.
    let url = format!("{}&timeoutSeconds=1", recorded.request_url);
    let (status, body) = get(&server, &url).await;
    assert_eq!(status.as_u16(), recorded.response_status_code);
    let got = lines(&body);
    let types = |v: &[Value]| v.iter().map(|e| e["type"].as_str().unwrap().to_string()).collect::<Vec<_>>();
    assert_eq!(types(&got), types(&want));
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(keys(g), keys(w));
        assert_eq!(keys(&g["object"]), keys(&w["object"]), "{}", g["type"]);
    }
    let (gb, wb) = (&got.last().unwrap()["object"], &want.last().unwrap()["object"]);
    let mut gb_cmp = gb.clone();
    gb_cmp["metadata"]["resourceVersion"] = wb["metadata"]["resourceVersion"].clone();
    assert_eq!(&gb_cmp, wb, "the initial-events-end bookmark, byte for byte but its resourceVersion");
    // Every ADDED object is the recorded pod (server-assigned fields aside).
    for (g, w) in got.iter().zip(&want).filter(|(g, _)| g["type"] == "ADDED") {
        assert_eq!(without_server_fields(g["object"].clone()), without_server_fields(w["object"].clone()));
    }
    // kube-rs decodes every event of both streams.
    for e in want.iter().chain(&got) {
        let parsed: WatchEvent<Pod> = serde_json::from_value(e.clone()).unwrap();
        assert!(!matches!(parsed, WatchEvent::Error(_)));
    }
}

#[tokio::test]
async fn plain_watch_without_resource_version_sends_one_added_per_object() {
    let recorded = &fixture("watch_event-watch_pods.json")[0];
    let want = lines(&recorded.response_body);
    assert!(want.iter().all(|e| e["type"] == "ADDED"));
    // The cluster held other pods when this was recorded: load those.
    let server = ApiServer::start().await.unwrap();
    for e in &want {
        server.store().create(&ResourceType::of::<Pod>(), None, e["object"].clone()).unwrap();
    }
    let (status, body) = get(&server, &format!("{}&timeoutSeconds=1", recorded.request_url)).await;
    assert_eq!(status.as_u16(), recorded.response_status_code);
    let got = lines(&body);
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g["type"], "ADDED");
        assert_eq!(keys(&g["object"]), keys(&w["object"]), "watch objects carry kind/apiVersion");
        assert_eq!(without_server_fields(g["object"].clone()), without_server_fields(w["object"].clone()));
    }
}

#[tokio::test]
async fn custom_resource_list_and_delete_match_the_recorded_ones() {
    let exchanges = fixture("custom_resource_definition-test.json");
    let find = |method: &str, suffix: &str| {
        exchanges.iter().find(|e| e.request_method == method && e.request_url.ends_with(suffix)).unwrap()
    };
    let recorded_list = find("GET", "/namespaces/default/foobars");
    let want: Value = serde_json::from_str(&recorded_list.response_body).unwrap();
    let server = ApiServer::start().await.unwrap();
    let foobar = ResourceType {
        group: "k8s-openapi-tests-custom-resource-definition.com".into(),
        version: "v1".into(),
        kind: "FooBar".into(),
        plural: "foobars".into(),
        builtin: false,
        field_labels: vec!["metadata.name", "metadata.namespace"],
    };
    server.store().register(foobar.clone());
    for item in want["items"].as_array().unwrap() {
        server.store().create(&foobar, None, item.clone()).unwrap();
    }
    let (status, body) = get(&server, &recorded_list.request_url).await;
    assert_eq!(status.as_u16(), recorded_list.response_status_code);
    let got: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(keys(&got), keys(&want));
    assert_eq!(keys(&got["metadata"]), keys(&want["metadata"]), "custom lists carry continue: \"\"");
    assert_eq!(got["metadata"]["continue"], "");
    assert_eq!(got["kind"], want["kind"]);
    for (g, w) in got["items"].as_array().unwrap().iter().zip(want["items"].as_array().unwrap()) {
        assert_eq!(keys(g), keys(w), "custom list items keep kind/apiVersion");
        assert_eq!(without_server_fields(g.clone()), without_server_fields(w.clone()));
    }

    let recorded_delete = find("DELETE", "/foobars/fb1");
    let want_status: Value = serde_json::from_str(&recorded_delete.response_body).unwrap();
    let client = server.client("default").unwrap();
    let req = Request::delete(&recorded_delete.request_url).body(kube::client::Body::empty()).unwrap();
    let resp = client.send(req).await.unwrap();
    assert_eq!(resp.status().as_u16(), recorded_delete.response_status_code);
    let got_status: Value = serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(keys(&got_status), keys(&want_status));
    assert_eq!(keys(&got_status["details"]), keys(&want_status["details"]));
    assert_eq!(got_status["status"], "Success");
}

/// Recorded from a v1.36.1 API server: `kubectl get --raw '/api/v1/pods?watch=true&resourceVersion=1'`
/// answered `200 OK` with this single line.
const RECORDED_EXPIRED_WATCH: &str = r#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"too old resource version: 1 (3171407)","reason":"Expired","code":410}}"#;

#[tokio::test]
async fn resuming_from_a_compacted_version_is_an_in_band_410() {
    let (server, _) = server_with_recorded_pods().await;
    server.store().expire_history();
    let (status, body) = get(&server, "/api/v1/pods?watch=true&resourceVersion=1&timeoutSeconds=1").await;
    assert_eq!(status, StatusCode::OK, "the real server answers 200 and puts the 410 in the stream");
    let got = lines(&body);
    let want: Value = serde_json::from_str(RECORDED_EXPIRED_WATCH).unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(keys(&got[0]), keys(&want));
    assert_eq!(keys(&got[0]["object"]), keys(&want["object"]));
    for k in ["kind", "apiVersion", "metadata", "status", "reason", "code"] {
        assert_eq!(got[0]["object"][k], want["object"][k], "{k}");
    }
    let msg = got[0]["object"]["message"].as_str().unwrap();
    assert!(msg.starts_with("too old resource version: 1 ("), "{msg}");
    match serde_json::from_value::<WatchEvent<Pod>>(got[0].clone()).unwrap() {
        WatchEvent::Error(s) => assert_eq!(s.code, 410),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn pagination_walks_a_consistent_snapshot_and_expires() {
    let (server, items) = server_with_recorded_pods().await;
    let (_, page1) = get(&server, "/api/v1/namespaces/kube-system/pods?limit=3").await;
    let page1: Value = serde_json::from_str(&page1).unwrap();
    assert_eq!(page1["items"].as_array().unwrap().len(), 3);
    let token = page1["metadata"]["continue"].as_str().unwrap().to_string();
    assert_eq!(page1["metadata"]["remainingItemCount"], items.len() - 3);
    // A write between pages does not show in the rest of this list (the snapshot's version).
    server
        .store()
        .delete(&ResourceType::of::<Pod>(), "kube-system", items.last().unwrap()["metadata"]["name"].as_str().unwrap())
        .unwrap();
    let (_, page2) = get(&server, &format!("/api/v1/namespaces/kube-system/pods?limit=100&continue={token}")).await;
    let page2: Value = serde_json::from_str(&page2).unwrap();
    assert_eq!(page2["metadata"]["resourceVersion"], page1["metadata"]["resourceVersion"]);
    let names: Vec<&str> = page1["items"]
        .as_array()
        .unwrap()
        .iter()
        .chain(page2["items"].as_array().unwrap())
        .map(|p| p["metadata"]["name"].as_str().unwrap())
        .collect();
    let mut want: Vec<&str> = items.iter().map(|p| p["metadata"]["name"].as_str().unwrap()).collect();
    want.sort_unstable();
    assert_eq!(names, want, "all pods once, in key order, as of the first page");
    // Once the history is gone, the token is an HTTP 410 with reason Expired.
    server.store().expire_history();
    let (status, body) = get(&server, &format!("/api/v1/namespaces/kube-system/pods?limit=100&continue={token}")).await;
    assert_eq!(status, StatusCode::GONE);
    let s: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (s["reason"].as_str(), s["code"].as_u64(), s["status"].as_str()),
        (Some("Expired"), Some(410), Some("Failure"))
    );
}
