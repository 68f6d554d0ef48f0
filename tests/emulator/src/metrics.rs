//! vLLM's `/metrics`: Prometheus text with vLLM 0.33's metric names, help texts and labels (see
//! `tests/fixtures/vllm-metrics/`), rendered by hand so the bytes look like `prometheus_client`'s.
//!
//! Concurrency: counters and gauges are atomics updated by engine tasks; the TTFT histogram and
//! the per-adapter request counts sit behind short `parking_lot` mutexes. Rendering reads them
//! without stopping the engine, so one scrape is not an atomic snapshot (neither is vLLM's).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

/// Bucket bounds of `vllm:time_to_first_token_seconds`, in seconds (vLLM 0.33).
pub const TTFT_BUCKETS_S: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];

/// Why a request finished, the `finished_reason` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// Stopped on EOS or a stop string (the emulator never does).
    Stop,
    /// Reached `max_tokens`.
    Length,
    /// The client went away.
    Abort,
}

impl FinishReason {
    /// The label / OpenAI `finish_reason` value.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

#[derive(Debug, Default)]
struct Histogram {
    counts: [u64; TTFT_BUCKETS_S.len()],
    count: u64,
    sum: f64,
}

/// Static labels and facts rendered into info metrics.
#[derive(Debug, Clone)]
pub struct MetricsInfo {
    /// The served model (`model_name` label).
    pub model_name: String,
    /// Tokens per block.
    pub block_size: u32,
    /// KV blocks, vLLM's `num_gpu_blocks` (the null block included).
    pub num_gpu_blocks: u32,
    /// `Some(max_lora)` when LoRA is enabled.
    pub max_loras: Option<u32>,
}

/// All engine metrics.
#[derive(Debug)]
pub struct Metrics {
    info: MetricsInfo,
    created_s: f64,
    /// Requests running now.
    pub running: AtomicU64,
    /// Requests waiting for a slot now.
    pub waiting: AtomicU64,
    /// Blocks held by running requests (for `kv_cache_usage_perc`, over `num_gpu_blocks − 1`).
    pub blocks_in_use: AtomicU64,
    prefix_queries: AtomicU64,
    prefix_hits: AtomicU64,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    success: [AtomicU64; 3],
    ttft: Mutex<Histogram>,
    /// adapter name -> (running, waiting) request counts.
    lora_requests: Mutex<BTreeMap<String, (u64, u64)>>,
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// Escapes a Prometheus label value.
fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Formats a float as Python's `repr` does for these values (`7.0`, `0.4213`).
fn num(v: f64) -> String {
    if v.is_infinite() { if v > 0.0 { "+Inf".into() } else { "-Inf".into() } } else { format!("{v:?}") }
}

impl Metrics {
    /// Zeroed metrics.
    pub fn new(info: MetricsInfo) -> Self {
        Self {
            info,
            created_s: unix_now(),
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            blocks_in_use: AtomicU64::new(0),
            prefix_queries: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            success: Default::default(),
            ttft: Mutex::new(Histogram::default()),
            lora_requests: Mutex::new(BTreeMap::new()),
        }
    }

    /// Counts a prefix-cache lookup: `queried` prompt tokens, of which `hit` were cached.
    pub fn record_prefix_lookup(&self, queried: u64, hit: u64) {
        self.prefix_queries.fetch_add(queried, Ordering::Relaxed);
        self.prefix_hits.fetch_add(hit, Ordering::Relaxed);
        self.prompt_tokens.fetch_add(queried, Ordering::Relaxed);
    }

    /// Counts one generated token.
    pub fn record_generated_token(&self) {
        self.generation_tokens.fetch_add(1, Ordering::Relaxed);
    }

    /// Observes one time to first token, in seconds.
    pub fn observe_ttft(&self, seconds: f64) {
        let mut h = self.ttft.lock();
        for (count, bound) in h.counts.iter_mut().zip(TTFT_BUCKETS_S) {
            if seconds <= bound {
                *count += 1;
            }
        }
        h.count += 1;
        h.sum += seconds;
    }

    /// Counts a finished request.
    pub fn record_finished(&self, reason: FinishReason) {
        let i = match reason {
            FinishReason::Stop => 0,
            FinishReason::Length => 1,
            FinishReason::Abort => 2,
        };
        self.success[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Moves an adapter's request count: `waiting_delta`/`running_delta` are +1 or -1.
    pub fn lora_request(&self, adapter: &str, waiting_delta: i64, running_delta: i64) {
        let mut map = self.lora_requests.lock();
        let entry = map.entry(adapter.to_string()).or_default();
        entry.0 = entry.0.saturating_add_signed(running_delta);
        entry.1 = entry.1.saturating_add_signed(waiting_delta);
        if *entry == (0, 0) {
            map.remove(adapter);
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let model = escape(&self.info.model_name);
        let labels = format!("engine=\"0\",model_name=\"{model}\"");
        let mut out = String::with_capacity(8192);
        let gauge = |out: &mut String, name: &str, help: &str, value: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {}", num(value));
        };
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        gauge(
            &mut out,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            load(&self.running),
        );
        gauge(
            &mut out,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            load(&self.waiting),
        );
        // vLLM's `BlockPool.get_usage`: its null block is never usable, so held / (N − 1).
        let usable = f64::from(self.info.num_gpu_blocks.saturating_sub(1));
        let usage = if usable > 0.0 { (load(&self.blocks_in_use) / usable).min(1.0) } else { 0.0 };
        gauge(&mut out, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage);

        let counter = |out: &mut String, name: &str, help: &str, series: &[(String, f64)]| {
            let _ = writeln!(out, "# HELP {name}_total {help}\n# TYPE {name}_total counter");
            for (labels, value) in series {
                let _ = writeln!(out, "{name}_total{{{labels}}} {}", num(*value));
            }
            let _ = writeln!(out, "# HELP {name}_created {help}\n# TYPE {name}_created gauge");
            for (labels, _) in series {
                let _ = writeln!(out, "{name}_created{{{labels}}} {}", num(self.created_s));
            }
        };
        let one = |a: &AtomicU64| vec![(labels.clone(), load(a))];
        counter(
            &mut out,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            &one(&self.prefix_queries),
        );
        counter(
            &mut out,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            &one(&self.prefix_hits),
        );
        counter(
            &mut out,
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            &[(labels.clone(), 0.0)],
        );
        counter(&mut out, "vllm:prompt_tokens", "Number of prefill tokens processed.", &one(&self.prompt_tokens));
        counter(
            &mut out,
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            &one(&self.generation_tokens),
        );
        let success: Vec<(String, f64)> = [FinishReason::Stop, FinishReason::Length, FinishReason::Abort]
            .iter()
            .zip(&self.success)
            .map(|(reason, count)| {
                (format!("engine=\"0\",finished_reason=\"{}\",model_name=\"{model}\"", reason.as_str()), load(count))
            })
            .collect();
        counter(&mut out, "vllm:request_success", "Count of successfully processed requests.", &success);

        {
            let h = self.ttft.lock();
            let name = "vllm:time_to_first_token_seconds";
            let help = "Histogram of time to first token in seconds.";
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
            for (count, bound) in h.counts.iter().zip(TTFT_BUCKETS_S) {
                let _ = writeln!(
                    out,
                    "{name}_bucket{{engine=\"0\",le=\"{}\",model_name=\"{model}\"}} {}",
                    num(bound),
                    num(*count as f64)
                );
            }
            let _ = writeln!(
                out,
                "{name}_bucket{{engine=\"0\",le=\"+Inf\",model_name=\"{model}\"}} {}",
                num(h.count as f64)
            );
            let _ = writeln!(out, "{name}_count{{{labels}}} {}", num(h.count as f64));
            let _ = writeln!(out, "{name}_sum{{{labels}}} {}", num(h.sum));
            let _ = writeln!(out, "# HELP {name}_created {help}\n# TYPE {name}_created gauge");
            let _ = writeln!(out, "{name}_created{{{labels}}} {}", num(self.created_s));
        }

        if let Some(max_lora) = self.info.max_loras {
            let map = self.lora_requests.lock();
            let running: Vec<&str> = map.iter().filter(|(_, c)| c.0 > 0).map(|(n, _)| n.as_str()).collect();
            let waiting: Vec<&str> = map.iter().filter(|(_, c)| c.1 > 0).map(|(n, _)| n.as_str()).collect();
            let _ = writeln!(
                out,
                "# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge\n\
                 vllm:lora_requests_info{{max_lora=\"{max_lora}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} {}",
                escape(&running.join(",")),
                escape(&waiting.join(",")),
                num(unix_now())
            );
        }
        let _ = writeln!(
            out,
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n\
             vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",calculate_kv_scales=\"False\",enable_prefix_caching=\"True\",\
             engine=\"0\",gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\",num_gpu_blocks_override=\"None\",\
             prefix_caching_hash_algo=\"sha256\",sliding_window=\"None\",swap_space_bytes=\"0\"}} 1.0",
            self.info.block_size, self.info.num_gpu_blocks
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `name{labels}` series line of a text exposition, as (name, sorted labels, value).
    fn series(text: &str) -> Vec<(String, BTreeMap<String, String>, f64)> {
        text.lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .map(|line| {
                let (head, value) = line.rsplit_once(' ').unwrap();
                let (name, labels) = head.split_once('{').unwrap_or((head, "}"));
                let labels = labels.strip_suffix('}').unwrap();
                let labels = labels
                    .split("\",")
                    .filter(|kv| !kv.is_empty())
                    .map(|kv| {
                        let (k, v) = kv.split_once("=\"").unwrap();
                        (k.to_string(), v.trim_end_matches('"').to_string())
                    })
                    .collect();
                let value = if value == "+Inf" { f64::INFINITY } else { value.parse().unwrap() };
                (name.to_string(), labels, value)
            })
            .collect()
    }

    /// The same parser on vLLM's own fixture sees the same names and label keys as ours.
    #[test]
    fn names_and_labels_match_the_vllm_fixture() {
        let path = format!("{}/../fixtures/vllm-metrics/vllm-metrics-busy-lora.txt", env!("CARGO_MANIFEST_DIR"));
        let fixture = std::fs::read_to_string(path).unwrap();
        let metrics = Metrics::new(MetricsInfo {
            model_name: "m".into(),
            block_size: 16,
            num_gpu_blocks: 101,
            max_loras: Some(4),
        });
        metrics.running.store(2, Ordering::Relaxed);
        // 25 of the 100 usable blocks (one of the 101 is vLLM's null block).
        metrics.blocks_in_use.store(25, Ordering::Relaxed);
        metrics.record_prefix_lookup(64, 32);
        metrics.observe_ttft(0.03);
        metrics.record_finished(FinishReason::Length);
        metrics.lora_request("sql-lora", 0, 1);
        let ours = series(&metrics.render());
        let theirs = series(&fixture);
        let keys = |s: &[(String, BTreeMap<String, String>, f64)], name: &str| {
            s.iter().find(|(n, _, _)| n == name).map(|(_, l, _)| l.keys().cloned().collect::<Vec<_>>())
        };
        for name in [
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:cache_config_info",
            "vllm:lora_requests_info",
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
            "vllm:request_success_total",
            "vllm:time_to_first_token_seconds_bucket",
            "vllm:time_to_first_token_seconds_count",
            "vllm:time_to_first_token_seconds_sum",
        ] {
            assert!(keys(&ours, name).is_some(), "{name} missing");
            assert_eq!(keys(&ours, name), keys(&theirs, name), "labels of {name}");
        }
        let value = |name: &str| ours.iter().find(|(n, _, _)| n == name).unwrap().2;
        assert_eq!(value("vllm:num_requests_running"), 2.0);
        assert_eq!(value("vllm:kv_cache_usage_perc"), 0.25);
        assert_eq!(value("vllm:prefix_cache_hits_total"), 32.0);
        let lora = ours.iter().find(|(n, _, _)| n == "vllm:lora_requests_info").unwrap();
        assert_eq!(lora.1["running_lora_adapters"], "sql-lora");
        assert!(lora.2 > 1.7e9, "value is a unix timestamp");
        let cache = ours.iter().find(|(n, _, _)| n == "vllm:cache_config_info").unwrap();
        assert_eq!((cache.1["block_size"].as_str(), cache.1["num_gpu_blocks"].as_str()), ("16", "101"));
        let ttft_bucket_004 =
            ours.iter().find(|(n, l, _)| n == "vllm:time_to_first_token_seconds_bucket" && l["le"] == "0.04").unwrap();
        assert_eq!(ttft_bucket_004.2, 1.0);
    }
}
