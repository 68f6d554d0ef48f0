//! Drives a [`Workload`] through a gateway the way chat users do: conversations arrive one after
//! another (`arrival_gap`), and each user sends their next turn once the previous reply is in
//! (after `think_time`), carrying the whole history.

use crate::client::{ChatOutcome, GatewayClient};
use crate::workload::Workload;
use anyhow::Result;
use std::time::Duration;

/// One request's result, with where it sits in the workload.
#[derive(Clone, Debug)]
pub struct TurnRecord {
    pub conversation: usize,
    pub system_prompt: usize,
    pub turn: usize,
    pub outcome: ChatOutcome,
}

/// Pacing of a chat workload run.
#[derive(Clone, Copy, Debug)]
pub struct Pacing {
    /// Time between the starts of consecutive conversations.
    pub arrival_gap: Duration,
    /// Time a user waits after a reply before sending the next turn.
    pub think_time: Duration,
    /// Output tokens per reply.
    pub max_tokens: u32,
}

/// Sends every turn of `workload` to `client`; calls `on_record` as each request finishes and
/// returns all records in completion order.
pub async fn run_chat_workload(
    client: &GatewayClient,
    model: &str,
    workload: &Workload,
    pacing: Pacing,
    mut on_record: impl FnMut(&TurnRecord),
) -> Result<Vec<TurnRecord>> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Result<TurnRecord>>();
    for (i, c) in workload.conversations.iter().enumerate() {
        let (client, model, workload, c, tx) =
            (client.clone(), model.to_string(), workload.clone(), c.clone(), tx.clone());
        tokio::spawn(async move {
            tokio::time::sleep(pacing.arrival_gap * i as u32).await;
            let mut replies = Vec::new();
            for turn in 0..c.user_messages.len() {
                if turn > 0 {
                    tokio::time::sleep(pacing.think_time).await;
                }
                let messages = workload.messages(&c, turn, &replies);
                let outcome = match client.chat(&model, &messages, pacing.max_tokens).await {
                    Ok(o) => o,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                replies.push(outcome.text.clone());
                let record = TurnRecord { conversation: c.id, system_prompt: c.system_prompt, turn, outcome };
                if tx.send(Ok(record)).is_err() {
                    return;
                }
            }
        });
    }
    drop(tx);
    let mut records = Vec::new();
    while let Some(record) = rx.recv().await {
        let record = record?;
        on_record(&record);
        records.push(record);
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
        let p90 = crate::stats::percentile(&ttfts, 0.9).unwrap_or(0.0);
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
