//! Drives a [`Workload`] through a gateway: turn by turn, every conversation's next turn sent
//! concurrently, each turn carrying the replies the earlier turns got.

use crate::client::{ChatOutcome, GatewayClient};
use crate::workload::Workload;
use anyhow::Result;

/// One request's result, with where it sits in the workload.
#[derive(Clone, Debug)]
pub struct TurnRecord {
    pub conversation: usize,
    pub system_prompt: usize,
    pub turn: usize,
    pub outcome: ChatOutcome,
}

/// Sends every turn of `workload` to `client`; calls `on_record` as each turn's requests finish
/// (in conversation order) and returns all records.
pub async fn run_chat_workload(
    client: &GatewayClient,
    model: &str,
    workload: &Workload,
    max_tokens: u32,
    mut on_record: impl FnMut(&TurnRecord),
) -> Result<Vec<TurnRecord>> {
    let turns = workload.conversations.iter().map(|c| c.user_messages.len()).max().unwrap_or(0);
    let mut replies: Vec<Vec<String>> = vec![Vec::new(); workload.conversations.len()];
    let mut records = Vec::new();
    for turn in 0..turns {
        let sends = workload.conversations.iter().filter(|c| turn < c.user_messages.len()).map(|c| {
            let messages = workload.messages(c, turn, &replies[c.id]);
            let client = client.clone();
            async move { (c, client.chat(model, &messages, max_tokens).await) }
        });
        for (c, result) in futures::future::join_all(sends).await {
            let outcome = result?;
            replies[c.id].push(outcome.text.clone());
            let record = TurnRecord { conversation: c.id, system_prompt: c.system_prompt, turn, outcome };
            on_record(&record);
            records.push(record);
        }
    }
    Ok(records)
}

/// Aggregate of a run: cache hit rate (cached / prompt tokens), TTFT mean and p90, errors.
#[derive(Clone, Debug, Default)]
pub struct RunSummary {
    pub requests: usize,
    pub errors: usize,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub mean_ttft_ms: f64,
    pub p90_ttft_ms: f64,
}

impl RunSummary {
    pub fn of(records: &[TurnRecord]) -> Self {
        let mut ttfts: Vec<f64> =
            records.iter().filter_map(|r| r.outcome.ttft).map(|d| d.as_secs_f64() * 1000.0).collect();
        ttfts.sort_by(f64::total_cmp);
        let mean = if ttfts.is_empty() { 0.0 } else { ttfts.iter().sum::<f64>() / ttfts.len() as f64 };
        let p90 = ttfts.get(((ttfts.len() as f64 * 0.9).ceil() as usize).saturating_sub(1)).copied().unwrap_or(0.0);
        Self {
            requests: records.len(),
            errors: records.iter().filter(|r| r.outcome.status != 200).count(),
            prompt_tokens: records.iter().map(|r| r.outcome.prompt_tokens as u64).sum(),
            cached_tokens: records.iter().map(|r| r.outcome.cached_tokens as u64).sum(),
            mean_ttft_ms: mean,
            p90_ttft_ms: p90,
        }
    }

    /// Cached prompt tokens over all prompt tokens, in [0,1].
    pub fn hit_rate(&self) -> f64 {
        if self.prompt_tokens == 0 { 0.0 } else { self.cached_tokens as f64 / self.prompt_tokens as f64 }
    }
}
