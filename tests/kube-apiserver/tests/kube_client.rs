//! kube-runtime's watcher against the stand-in, for the protocol features kvroute's own watchers
//! do not exercise in their tests: streaming lists, `timeoutSeconds`, and BOOKMARKs keeping a
//! quiet watch resumable across a compaction (without them the resume is a `410`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::runtime::watcher::{self, Event};
use kvroute_kube_stand_in::{ApiServer, Options};

fn pod(name: &str) -> Pod {
    Pod {
        metadata: ObjectMeta { name: Some(name.into()), namespace: Some("ns".into()), ..Default::default() },
        ..Default::default()
    }
}

fn slice(name: &str) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta { name: Some(name.into()), namespace: Some("ns".into()), ..Default::default() },
        address_type: "IPv4".into(),
        ..Default::default()
    }
}

async fn wait(mut cond: impl FnMut() -> bool) -> bool {
    for _ in 0..300 {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

#[tokio::test]
async fn streaming_list_then_timeouts_resume_without_relisting() {
    let server = ApiServer::start().await.unwrap();
    for n in ["a", "b"] {
        server.create(&pod(n)).unwrap();
    }
    let api: Api<Pod> = Api::namespaced(server.client("ns").unwrap(), "ns");
    let mut events = watcher::watcher(api, watcher::Config::default().streaming_lists().timeout(1)).boxed();
    let mut names = Vec::new();
    loop {
        match events.next().await.unwrap().unwrap() {
            Event::Init => {}
            Event::InitApply(p) => names.push(p.metadata.name.unwrap()),
            Event::InitDone => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(names, ["a", "b"]);
    assert_eq!(server.counts::<Pod>().lists, 0, "a streaming list is a watch");
    // The server ends each watch after timeoutSeconds=1; the watcher resumes from its version.
    let drive = tokio::spawn(async move { while events.next().await.is_some() {} });
    assert!(wait(|| server.counts::<Pod>().watches >= 3).await, "{:?}", server.counts::<Pod>());
    assert_eq!((server.counts::<Pod>().lists, server.counts::<Pod>().expired), (0, 0));
    drive.abort();
}

/// A Pod watch sees no Pod changes while other resources advance the cluster's resourceVersion
/// past the server's (small) history; then its connection drops.
async fn quiet_watch_then_drop(bookmarks: bool) -> kvroute_kube_stand_in::apiserver::RequestCounts {
    let options = Options { history: 4, bookmark_interval: Duration::from_millis(50), ..Options::default() };
    let server = ApiServer::start_with("127.0.0.1:0".parse().unwrap(), options).await.unwrap();
    server.create(&pod("a")).unwrap();
    let api: Api<Pod> = Api::namespaced(server.client("ns").unwrap(), "ns");
    let mut config = watcher::Config::default();
    if !bookmarks {
        config = config.disable_bookmarks();
    }
    let mut events = watcher::watcher(api, config).boxed();
    while !matches!(events.next().await.unwrap().unwrap(), Event::InitDone) {}
    let drive = tokio::spawn(async move { while events.next().await.is_some() {} });
    assert!(wait(|| server.counts::<Pod>().watches == 1).await);
    for i in 0..10 {
        server.create(&slice(&format!("s{i}"))).unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await; // a few bookmark periods
    server.store().drop_watches();
    assert!(wait(|| server.counts::<Pod>().watches >= 2).await);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let counts = server.counts::<Pod>();
    drive.abort();
    counts
}

#[tokio::test]
async fn bookmarks_keep_a_quiet_watch_resumable() {
    let with = quiet_watch_then_drop(true).await;
    assert_eq!((with.expired, with.lists), (0, 1), "resumed from the bookmark's version: {with:?}");
    let without = quiet_watch_then_drop(false).await;
    assert!(without.expired >= 1 && without.lists >= 2, "without bookmarks the version expired: {without:?}");
}

/// TokenReview through kube-rs' typed client: the request and the answer (de)serialise as
/// `authentication.k8s.io/v1` types, for a pod-bound token and a refused one.
#[tokio::test]
async fn token_reviews_round_trip_through_kube_rs() {
    use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
    use kube::api::PostParams;
    use kvroute_kube_stand_in::TokenSpec;
    let server = ApiServer::start().await.unwrap();
    let agent = server.create(&pod("agent-x")).unwrap();
    let uid = agent.metadata.uid.unwrap();
    let token = server.issue_token(TokenSpec::pod_bound("ns", "agent", "kvroute-picker", "agent-x", &uid, "n1"));
    let api: Api<TokenReview> = Api::all(server.client("ns").unwrap());
    let review = |token: &str, aud: &str| TokenReview {
        spec: TokenReviewSpec { token: Some(token.into()), audiences: Some(vec![aud.into()]) },
        ..Default::default()
    };
    let ok = api.create(&PostParams::default(), &review(&token, "kvroute-picker")).await.unwrap().status.unwrap();
    assert_eq!(ok.authenticated, Some(true));
    assert_eq!(ok.audiences.as_deref(), Some(&["kvroute-picker".to_string()][..]));
    let user = ok.user.unwrap();
    assert_eq!(user.username.as_deref(), Some("system:serviceaccount:ns:agent"));
    let extra = user.extra.unwrap();
    assert_eq!(extra["authentication.kubernetes.io/pod-uid"], [uid]);
    assert_eq!(extra["authentication.kubernetes.io/node-name"], ["n1"]);
    let refused = api.create(&PostParams::default(), &review(&token, "api")).await.unwrap().status.unwrap();
    assert_eq!(refused.authenticated, None);
    assert!(refused.error.unwrap().contains("invalid for the target audiences"));
    // Once the pod is gone, so is its token.
    server.delete::<Pod>("ns", "agent-x").unwrap();
    let gone = api.create(&PostParams::default(), &review(&token, "kvroute-picker")).await.unwrap().status.unwrap();
    assert_eq!(gone.authenticated, None);
    assert_eq!(server.token_reviews(), 3);
}
