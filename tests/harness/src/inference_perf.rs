//! inference-perf 0.7.0 (PyPI; the Gateway API Inference Extension's benchmark tool, docs/design.md §13) as
//! the load client of end-to-end benchmarks: writes its config, runs it as a child process with a
//! deadline, and reads its per-stage reports.
//!
//! The config keys are the ones inference-perf's pydantic models accept (`extra="forbid"`: an
//! unknown key fails the run), checked against `inference_perf/config/` of 0.7.0:
//! `data.shared_prefix.{num_groups, num_prompts_per_group, system_prompt_len, question_len,
//! output_len, seed}` (lengths in tokens of the configured tokenizer), `load.{type, stages[{rate,
//! duration}]}`, `api.{type, streaming}`, `server.{type, model_name, base_url, ignore_eos}`,
//! `tokenizer.pretrained_model_name_or_path` (a local directory: no hub access here) and
//! `storage.local_storage.path`. Reports are `<path>/stage_<N>_lifecycle_metrics.json` (one per
//! load stage, N from 0) and `summary_lifecycle_metrics.json`; latencies are in seconds, under
//! `successes.latency.<metric>.{median, p90, p99, …}` (`reportgen/base.py: summarize`).
//!
//! No shared state: every function works on its arguments and the files it is pointed at.

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

/// llm-d's shared-prefix shape as inference-perf's `shared_prefix` generator takes it. Every
/// length is in tokens of the tokenizer named in the config (the fleet's Qwen2.5 fixture).
#[derive(Clone, Debug, PartialEq)]
pub struct SharedPrefixShape {
    /// Groups, each with its own shared system prompt.
    pub num_groups: u64,
    /// Distinct questions per group.
    pub num_prompts_per_group: u64,
    /// Tokens per shared system prompt.
    pub system_prompt_len: u64,
    /// Tokens per question (appended after the system prompt).
    pub question_len: u64,
    /// Output tokens per request (`max_tokens`; inference-perf always sends `ignore_eos`).
    pub output_len: u64,
    /// Prompt-generation seed.
    pub seed: u64,
}

/// One load stage: Poisson arrivals at `rate` requests per second for `duration_s` seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoadStage {
    /// Requests per second.
    pub rate: f64,
    /// Seconds.
    pub duration_s: u64,
}

/// The inference-perf config (as a JSON value; written as YAML) for streaming `/v1/completions`
/// of `shape` through `base_url` (e.g. `http://127.0.0.1:8080`), reports under `report_dir`.
pub fn config(
    shape: &SharedPrefixShape,
    stages: &[LoadStage],
    base_url: &str,
    model: &str,
    tokenizer_dir: &Path,
    report_dir: &Path,
) -> Value {
    json!({
        "api": {"type": "completion", "streaming": true},
        "data": {
            "type": "shared_prefix",
            "shared_prefix": {
                "num_groups": shape.num_groups,
                "num_prompts_per_group": shape.num_prompts_per_group,
                "system_prompt_len": shape.system_prompt_len,
                "question_len": shape.question_len,
                "output_len": shape.output_len,
                "seed": shape.seed,
            },
        },
        "load": {
            "type": "poisson",
            "stages": stages.iter().map(|s| json!({"rate": s.rate, "duration": s.duration_s})).collect::<Vec<_>>(),
            // The default is time-based; a fixed seed makes the three gateways see the same arrivals.
            "base_seed": shape.seed,
        },
        "server": {"type": "vllm", "model_name": model, "base_url": base_url, "ignore_eos": true},
        "tokenizer": {"pretrained_model_name_or_path": tokenizer_dir.to_string_lossy()},
        "storage": {"local_storage": {"path": report_dir.to_string_lossy()}},
    })
}

/// Writes `config` as YAML to `path`.
pub fn write_config(path: &Path, config: &Value) -> Result<()> {
    let yaml = serde_norway::to_string(config).context("serializing the inference-perf config")?;
    std::fs::write(path, yaml).with_context(|| format!("writing {}", path.display()))
}

/// Runs `inference-perf --config_file <config>`; its output goes to `log`. Killed after `timeout`.
/// Fails with the log's tail when it exits non-zero or runs out of time.
pub async fn run(exe: &Path, config: &Path, log: &Path, timeout: Duration) -> Result<()> {
    let out = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let mut child = tokio::process::Command::new(exe)
        .arg("--config_file")
        .arg(config)
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| {
            format!("starting {} (install it with scripts/bench-shared-prefix-inference-perf)", exe.display())
        })?;
    let status = match tokio::time::timeout(timeout, child.wait()).await {
        Ok(status) => status?,
        Err(_) => {
            let _ = child.kill().await;
            bail!("inference-perf ran past {timeout:?}; last lines of {}:\n{}", log.display(), tail(log, 30));
        }
    };
    if !status.success() {
        bail!("inference-perf exited with {status}; last lines of {}:\n{}", log.display(), tail(log, 30));
    }
    Ok(())
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// What one stage report says (times in milliseconds, converted from inference-perf's seconds).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StageReport {
    /// Stage index (0-based, as in the file name).
    pub stage: usize,
    /// `load_summary.requested_rate`, requests per second.
    pub requested_rate: f64,
    /// `load_summary.achieved_rate`: how fast inference-perf actually sent.
    pub achieved_rate: f64,
    /// Successful requests.
    pub successes: u64,
    /// Failed requests.
    pub failures: u64,
    /// TTFT median / p90 / p99, ms.
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    /// Completed requests per second.
    pub requests_per_sec: f64,
    /// Output tokens per second.
    pub output_tokens_per_sec: f64,
    /// Prompt tokens, all and served from the prefix cache (`usage.prompt_tokens_details`).
    pub prompt_tokens: f64,
    pub cached_prompt_tokens: f64,
    /// One failure's label and message (`failures.by_label`), when any request failed.
    pub first_error: Option<String>,
}

impl StageReport {
    /// Parses one `stage_N_lifecycle_metrics.json` body. A stage with no successful request has
    /// no TTFT summary: its percentiles are NaN.
    pub fn parse(stage: usize, report: &Value) -> Result<Self> {
        let num = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
        let s = &report["successes"];
        if s.is_null() {
            bail!("stage {stage} report has no `successes` section");
        }
        let ttft = &s["latency"]["time_to_first_token"];
        Ok(Self {
            stage,
            requested_rate: num(&report["load_summary"]["requested_rate"]),
            achieved_rate: num(&report["load_summary"]["achieved_rate"]),
            successes: s["count"].as_u64().unwrap_or(0),
            failures: report["failures"]["count"].as_u64().unwrap_or(0),
            ttft_p50_ms: num(&ttft["median"]) * 1000.0,
            ttft_p90_ms: num(&ttft["p90"]) * 1000.0,
            ttft_p99_ms: num(&ttft["p99"]) * 1000.0,
            requests_per_sec: num(&s["throughput"]["requests_per_sec"]),
            output_tokens_per_sec: num(&s["throughput"]["output_tokens_per_sec"]),
            prompt_tokens: s["prompt_tokens"]["total"].as_f64().unwrap_or(0.0),
            cached_prompt_tokens: s["prompt_tokens"]["cached"].as_f64().unwrap_or(0.0),
            first_error: report["failures"]["by_label"].as_object().and_then(|labels| {
                let (label, entry) = labels.iter().next()?;
                Some(format!("{label}: {}", entry["messages"][0]["message"].as_str().unwrap_or("")))
            }),
        })
    }

    /// Cached over all prompt tokens, in [0,1].
    pub fn hit_rate(&self) -> f64 {
        if self.prompt_tokens > 0.0 { self.cached_prompt_tokens / self.prompt_tokens } else { 0.0 }
    }
}

/// Reads `stage_0_lifecycle_metrics.json` … `stage_{stages-1}_…` from `report_dir`.
pub fn read_stage_reports(report_dir: &Path, stages: usize) -> Result<Vec<StageReport>> {
    (0..stages)
        .map(|i| {
            let path = stage_report_path(report_dir, i);
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {} (did the stage send any request?)", path.display()))?;
            let value: Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
            StageReport::parse(i, &value).with_context(|| format!("in {}", path.display()))
        })
        .collect()
}

/// `<report_dir>/stage_<i>_lifecycle_metrics.json`.
pub fn stage_report_path(report_dir: &Path, stage: usize) -> PathBuf {
    report_dir.join(format!("stage_{stage}_lifecycle_metrics.json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> SharedPrefixShape {
        SharedPrefixShape {
            num_groups: 24,
            num_prompts_per_group: 5,
            system_prompt_len: 1440,
            question_len: 240,
            output_len: 16,
            seed: 1,
        }
    }

    #[test]
    fn config_uses_inference_perf_keys() {
        let stages = [LoadStage { rate: 2.0, duration_s: 30 }, LoadStage { rate: 4.0, duration_s: 30 }];
        let c = config(&shape(), &stages, "http://127.0.0.1:1", "m", Path::new("/tok"), Path::new("/out"));
        assert_eq!(c["data"]["type"], "shared_prefix");
        assert_eq!(c["data"]["shared_prefix"]["system_prompt_len"], 1440);
        assert_eq!(c["load"]["type"], "poisson");
        assert_eq!(c["load"]["stages"][1], json!({"rate": 4.0, "duration": 30}));
        assert_eq!(c["api"], json!({"type": "completion", "streaming": true}));
        assert_eq!(c["server"]["model_name"], "m");
        assert_eq!(c["tokenizer"]["pretrained_model_name_or_path"], "/tok");
        assert_eq!(c["storage"]["local_storage"]["path"], "/out");
        let yaml = serde_norway::to_string(&c).unwrap();
        assert!(yaml.contains("num_prompts_per_group: 5"), "{yaml}");
    }

    #[test]
    fn stage_report_reads_seconds_as_ms() {
        let report = json!({
            "load_summary": {"count": 60, "requested_rate": 2.0, "achieved_rate": 1.9},
            "successes": {
                "count": 59,
                "latency": {"time_to_first_token": {"mean": 0.2, "median": 0.05, "p90": 0.3, "p99": 0.4}},
                "throughput": {"requests_per_sec": 1.95, "output_tokens_per_sec": 31.2},
                "prompt_tokens": {"total": 1000.0, "cached": 750.0, "uncached": 250.0},
            },
            "failures": {"count": 1},
        });
        let r = StageReport::parse(0, &report).unwrap();
        assert_eq!((r.successes, r.failures), (59, 1));
        assert!((r.ttft_p50_ms - 50.0).abs() < 1e-9 && (r.ttft_p90_ms - 300.0).abs() < 1e-9);
        assert!((r.hit_rate() - 0.75).abs() < 1e-12);
        assert!((r.achieved_rate - 1.9).abs() < 1e-12);
    }

    #[test]
    fn stage_without_successes_has_nan_percentiles() {
        // The shape inference-perf 0.7.0 wrote for a stage whose requests all failed.
        let report = json!({"load_summary": {}, "successes": {"count": 0, "latency": {"time_to_first_token": null}},
                            "failures": {"count": 5, "by_label": {"Connection Error": {"count": 5,
                                "messages": [{"message": "Cannot connect to host 127.0.0.1:1"}]}}}});
        let r = StageReport::parse(2, &report).unwrap();
        assert!(r.ttft_p90_ms.is_nan());
        assert_eq!(r.failures, 5);
        assert_eq!(r.first_error.as_deref(), Some("Connection Error: Cannot connect to host 127.0.0.1:1"));
        assert!(StageReport::parse(0, &json!({})).is_err());
    }
}
