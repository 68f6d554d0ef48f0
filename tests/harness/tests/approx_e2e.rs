//! End to end in approximate mode (docs/design.md §6): emulated engines, agents, the picker started
//! *without a tokenizer* for the model, and a real Envoy 1.40. The picker only sees request text
//! and its own past decisions; turn 2 of each conversation must still land on turn 1's pod (and
//! the engine must report the history as cached).
//!
//! Needs the workspace binaries (`cargo build --bins`) and Envoy (`scripts/install-envoy`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute_harness::{ChatOutcome, Fleet, FleetSpec, GatewayClient, Workload};
use serde_json::Value;

use kvroute_harness::DEFAULT_MODEL as MODEL;

async fn chat(client: &GatewayClient, messages: &[Value]) -> ChatOutcome {
    client.chat_served(MODEL, messages, 8).await.expect("request served through Envoy")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_two_lands_on_turn_ones_pod_without_a_tokenizer() {
    let spec =
        FleetSpec { label: "e2e-approx".into(), time_scale: 0.2, picker_approximate: true, ..Default::default() };
    let fleet = Fleet::start(spec).await.expect("fleet starts");
    let client = GatewayClient::new(&fleet.gateway).expect("client");
    // Four system prompts of ~600 words, one conversation each: four distinct long prefixes.
    let w = Workload::multi_turn_chat(23, 4, 1, 2, 600, 30);

    let mut first_pod = Vec::new();
    let mut replies = Vec::new();
    for c in &w.conversations {
        let out = chat(&client, &w.messages(c, 0, &[])).await;
        first_pod.push(out.served_by.clone().expect("served_by"));
        replies.push(vec![out.text]);
    }
    // No wait for KV events: approximate mode records the decision itself.
    for (i, c) in w.conversations.iter().enumerate() {
        let out = chat(&client, &w.messages(c, 1, &replies[i])).await;
        assert_eq!(out.served_by.as_deref(), Some(first_pod[i].as_str()), "conversation {i} turn 2 moved pods");
        assert!(
            out.cached_tokens * 2 > out.prompt_tokens,
            "conversation {i} turn 2: only {} of {} prompt tokens cached",
            out.cached_tokens,
            out.prompt_tokens
        );
    }
    let metrics = fleet.picker_metrics().await.expect("picker metrics");
    let ratio_sum: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("epp_cache_match_ratio_sum "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no epp_cache_match_ratio_sum in the picker's metrics"));
    assert!(ratio_sum > 3.0, "four turn-2 decisions with high match ratios expected, sum {ratio_sum}");
    fleet.shutdown().await;
}
