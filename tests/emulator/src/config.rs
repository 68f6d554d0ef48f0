//! Command-line configuration of the emulator, with the flag names of vLLM's `vllm serve` where
//! vLLM has an equivalent (the lead's harness and the demo depend on these names).
//!
//! Invariants after [`EmulatorConfig::validate`]: block size and max sequences are non-zero, at
//! least 2 GPU blocks, the time scale is finite and non-negative, and LoRA module specs are `name=path`.

use std::path::PathBuf;

use clap::Parser;

/// Why a configuration was rejected.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A numeric flag is out of range.
    #[error("invalid --{flag}: {reason}")]
    OutOfRange {
        /// The flag's name without dashes.
        flag: &'static str,
        /// What is wrong with the value and what is expected.
        reason: String,
    },
    /// A `--lora-modules` entry is not `name=path`.
    #[error("invalid --lora-modules entry {0:?}: expected NAME=PATH, e.g. sql-lora=/models/sql-lora")]
    LoraModule(String),
}

/// A LoRA adapter given with `--lora-modules name=path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraModule {
    /// Adapter name, as requests name it in `model`.
    pub name: String,
    /// Adapter path (only echoed in `/v1/models`; nothing is read from it).
    pub path: String,
}

/// Flags of `kvroute-emulator`. Every duration is multiplied by `time_scale`.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "kvroute-emulator",
    version = kvroute_cli::LONG_VERSION,
    about = "A vLLM stand-in: OpenAI API, vLLM /metrics, prefix cache, KV events over ZeroMQ"
)]
pub struct EmulatorConfig {
    /// HTTP listen host. Default 127.0.0.1.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// HTTP listen port; 0 picks a free one (printed in the READY line). Default 8000.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Served (base) model name, the `/v1/models` id. Default Qwen/Qwen2.5-7B-Instruct.
    #[arg(long, default_value = "Qwen/Qwen2.5-7B-Instruct")]
    pub model: String,
    /// HuggingFace tokenizer directory (tokenizer.json + tokenizer_config.json). Without it, or if
    /// it fails to load, only token-id prompts are served; text prompts get a 400.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Tokens per KV block (vLLM `--block-size`). Default 16.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// KV-cache blocks (vLLM's `num_gpu_blocks`, `--num-gpu-blocks-override`), at least 2: as in
    /// vLLM one is the null block, so `N − 1` hold KV and KV usage is held / (N − 1). Default 2048.
    #[arg(long, default_value_t = 2048)]
    pub num_gpu_blocks: u32,
    /// Maximum running requests; more wait in the queue. Default 8.
    #[arg(long, default_value_t = 8)]
    pub max_num_seqs: u32,
    /// Prefills that run at once (vLLM `--max-num-partial-prefills`, whose default is 1); the other
    /// admitted requests wait for a prefill slot, counted as waiting. A prefill's duration does not
    /// depend on how many run, so 1 models a GPU whose prefill compute is the bottleneck (cache
    /// misses cost throughput, not only latency). 0 = no limit: every running request prefills at
    /// once (the emulator's original model). Default 0.
    #[arg(long, default_value_t = 0)]
    pub max_num_partial_prefills: u32,
    /// Maximum prompt + output tokens per request. Default 32768.
    #[arg(long, default_value_t = 32768)]
    pub max_model_len: u32,
    /// Largest request body read, in bytes; a larger one is a 413. Default 268435456 (256 MiB,
    /// the largest `body_limit_bytes` the picker accepts; vLLM itself sets no limit).
    #[arg(long, default_value_t = 256 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// The tokenizer's image placeholder token, which the chat template renders once per image and
    /// the emulator expands to `--mm-tokens-per-image` tokens. Default `<|image_pad|>` (Qwen).
    #[arg(long, default_value = "<|image_pad|>")]
    pub mm_placeholder_token: String,
    /// Placeholder tokens per image: every image's with a fixed count, or with `--mm-vision`
    /// those the emulator cannot size (URLs it does not fetch). Default 256 (a 448×448 image
    /// under Qwen2-VL).
    #[arg(long, default_value_t = 256)]
    pub mm_tokens_per_image: usize,
    /// Count inline images' tokens from their size as the Qwen2-VL processor resizes them
    /// (docs/design.md §2), with the `--mm-patch-size`, `--mm-merge-size`, `--mm-min-pixels`
    /// and `--mm-max-pixels` settings. Default off (the fixed `--mm-tokens-per-image`).
    #[arg(long, default_value_t = false)]
    pub mm_vision: bool,
    /// Vision patch side in pixels (`--mm-vision`), 1..=1024. Default 14.
    #[arg(long, default_value_t = 14)]
    pub mm_patch_size: u32,
    /// Patches merged per side into one token (`--mm-vision`), 1..=64. Default 2.
    #[arg(long, default_value_t = 2)]
    pub mm_merge_size: u32,
    /// Smallest resized area in pixels (`--mm-vision`), >= 1. Default 3136.
    #[arg(long, default_value_t = 3136)]
    pub mm_min_pixels: u64,
    /// Largest resized area in pixels (`--mm-vision`), min..=178956970. Default 12845056.
    #[arg(long, default_value_t = 12_845_056)]
    pub mm_max_pixels: u64,
    /// Prefill time per uncached prompt token, in microseconds. Default 220.
    #[arg(long, default_value_t = 220.0)]
    pub prefill_us_per_token: f64,
    /// Decode time per generated token, in milliseconds. Default 20.
    #[arg(long, default_value_t = 20.0)]
    pub decode_ms_per_token: f64,
    /// Multiplies every simulated duration (0.05 = 20x faster). Default 1.0.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// ZeroMQ PUB endpoint for KV events (`tcp://127.0.0.1:*` picks a free port).
    #[arg(long, default_value = "tcp://127.0.0.1:5557")]
    pub kv_events_endpoint: String,
    /// ZeroMQ ROUTER endpoint for KV-event replay.
    #[arg(long, default_value = "tcp://127.0.0.1:5558")]
    pub kv_replay_endpoint: String,
    /// Topic frame of every KV-event message (llm-d convention `kv@<pod-ip>@<model>`). Default empty.
    #[arg(long, default_value = "")]
    pub kv_topic: String,
    /// Number of KV-event batches kept for replay. Default 10000.
    #[arg(long, default_value_t = 10_000)]
    pub kv_replay_buffer: usize,
    /// Pod name, sent as `x-served-by` on every response. Default engine-0.
    #[arg(long, default_value = "engine-0")]
    pub pod_name: String,
    /// LoRA adapters served at start, `name=path`; repeatable or space separated.
    #[arg(long, num_args = 1..)]
    pub lora_modules: Vec<String>,
    /// Enable LoRA (implied by `--lora-modules`); adds `vllm:lora_requests_info` to /metrics.
    #[arg(long)]
    pub enable_lora: bool,
    /// `max_lora` label of `vllm:lora_requests_info`. Default 4.
    #[arg(long, default_value_t = 4)]
    pub max_loras: u32,
    /// Seed of the engine block hashes (vLLM's PYTHONHASHSEED role); random per process if unset.
    #[arg(long)]
    pub hash_seed: Option<u64>,
    /// Log filter (tracing env-filter syntax), JSON to stderr. Default info.
    #[arg(long, default_value = "info")]
    pub log_level: String,
    /// Start unhealthy (`/health` answers 503).
    #[arg(long)]
    pub fault_unhealthy: bool,
    /// Start stuck (`/health` 200, completions never start).
    #[arg(long)]
    pub fault_stuck: bool,
    /// Extra latency added before scheduling each request, in milliseconds (not time-scaled).
    #[arg(long, default_value_t = 0)]
    pub fault_extra_latency_ms: u64,
    /// Number of KV-event batches to drop (their seq numbers are still consumed).
    #[arg(long, default_value_t = 0)]
    pub fault_drop_kv_events: u32,
    /// Cut every stream after its first chunk.
    #[arg(long)]
    pub fault_die_mid_stream: bool,
}

impl EmulatorConfig {
    /// Checks ranges and parses `--lora-modules`, returning the adapters in order.
    pub fn validate(&self) -> Result<Vec<LoraModule>, ConfigError> {
        if self.num_gpu_blocks < 2 {
            return Err(ConfigError::OutOfRange {
                flag: "num-gpu-blocks",
                reason: format!(
                    "{} leaves no usable block: at least 2 (one is vLLM's null block)",
                    self.num_gpu_blocks
                ),
            });
        }
        let non_zero = [
            ("block-size", self.block_size),
            ("max-num-seqs", self.max_num_seqs),
            ("max-model-len", self.max_model_len),
        ];
        for (flag, value) in non_zero {
            if value == 0 {
                return Err(ConfigError::OutOfRange { flag, reason: "must be at least 1".into() });
            }
        }
        let non_negative = [
            ("prefill-us-per-token", self.prefill_us_per_token),
            ("decode-ms-per-token", self.decode_ms_per_token),
            ("time-scale", self.time_scale),
        ];
        for (flag, value) in non_negative {
            if !value.is_finite() || value < 0.0 {
                return Err(ConfigError::OutOfRange { flag, reason: format!("{value} is not a finite number >= 0") });
            }
        }
        if self.max_body_bytes == 0 {
            return Err(ConfigError::OutOfRange { flag: "max-body-bytes", reason: "must be at least 1".into() });
        }
        if self.mm_tokens_per_image == 0 {
            return Err(ConfigError::OutOfRange { flag: "mm-tokens-per-image", reason: "must be at least 1".into() });
        }
        let vision: [(&'static str, bool, &str); 4] = [
            ("mm-patch-size", (1..=1024).contains(&self.mm_patch_size), "must be 1..=1024"),
            ("mm-merge-size", (1..=64).contains(&self.mm_merge_size), "must be 1..=64"),
            ("mm-min-pixels", self.mm_min_pixels >= 1, "must be at least 1"),
            (
                "mm-max-pixels",
                (self.mm_min_pixels..=kvroute_common::image::MAX_IMAGE_PIXELS).contains(&self.mm_max_pixels),
                "must be mm-min-pixels..=178956970",
            ),
        ];
        if let Some((flag, _, why)) = vision.into_iter().find(|(_, ok, _)| !ok) {
            return Err(ConfigError::OutOfRange { flag, reason: why.into() });
        }
        if self.kv_replay_buffer == 0 {
            return Err(ConfigError::OutOfRange { flag: "kv-replay-buffer", reason: "must be at least 1".into() });
        }
        self.lora_modules
            .iter()
            .map(|spec| match spec.split_once('=') {
                Some((name, path)) if !name.is_empty() => {
                    Ok(LoraModule { name: name.to_string(), path: path.to_string() })
                }
                _ => Err(ConfigError::LoraModule(spec.clone())),
            })
            .collect()
    }

    /// Whether LoRA is enabled (flag or any `--lora-modules`).
    pub fn lora_enabled(&self) -> bool {
        self.enable_lora || !self.lora_modules.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_command_line() {
        let cfg = EmulatorConfig::try_parse_from([
            "kvroute-emulator",
            "--host",
            "127.0.0.1",
            "--port",
            "8000",
            "--model",
            "Qwen/Qwen2.5-7B-Instruct",
            "--tokenizer",
            "tests/fixtures/tokenizer-qwen2.5",
            "--block-size",
            "16",
            "--num-gpu-blocks",
            "2048",
            "--max-num-seqs",
            "8",
            "--prefill-us-per-token",
            "220",
            "--decode-ms-per-token",
            "20",
            "--time-scale",
            "1.0",
            "--kv-events-endpoint",
            "tcp://127.0.0.1:5557",
            "--kv-replay-endpoint",
            "tcp://127.0.0.1:5558",
            "--kv-topic",
            "kv@127.0.0.1@Qwen/Qwen2.5-7B-Instruct",
            "--pod-name",
            "engine-0",
            "--lora-modules",
            "sql-lora=/dev/null",
            "chat-lora=/tmp/x",
            "--max-loras",
            "4",
            "--log-level",
            "info",
        ])
        .unwrap();
        let loras = cfg.validate().unwrap();
        assert_eq!(loras.len(), 2);
        assert_eq!(loras[0], LoraModule { name: "sql-lora".into(), path: "/dev/null".into() });
        assert!(cfg.lora_enabled());
        assert_eq!(cfg.kv_topic, "kv@127.0.0.1@Qwen/Qwen2.5-7B-Instruct");
    }

    #[test]
    fn rejects_bad_values() {
        let cfg = EmulatorConfig::try_parse_from(["e", "--block-size", "0"]).unwrap();
        assert!(matches!(cfg.validate(), Err(ConfigError::OutOfRange { flag: "block-size", .. })));
        let cfg = EmulatorConfig::try_parse_from(["e", "--lora-modules", "nopath"]).unwrap();
        assert!(matches!(cfg.validate(), Err(ConfigError::LoraModule(_))));
        let cfg = EmulatorConfig::try_parse_from(["e", "--time-scale=-1"]).unwrap();
        assert!(cfg.validate().is_err());
        for (args, flag) in [
            (&["--mm-patch-size", "0"][..], "mm-patch-size"),
            (&["--mm-merge-size", "65"], "mm-merge-size"),
            (&["--mm-min-pixels", "0"], "mm-min-pixels"),
            (&["--mm-min-pixels", "5000", "--mm-max-pixels", "4000"], "mm-max-pixels"),
            (&["--mm-max-pixels", "178956971"], "mm-max-pixels"),
        ] {
            let cfg = EmulatorConfig::try_parse_from(["e"].iter().chain(args)).unwrap();
            assert!(matches!(cfg.validate(), Err(ConfigError::OutOfRange { flag: f, .. }) if f == flag), "{args:?}");
        }
        let cfg = EmulatorConfig::try_parse_from(["e", "--mm-vision"]).unwrap();
        assert!(cfg.validate().is_ok() && cfg.mm_vision && (cfg.mm_patch_size, cfg.mm_max_pixels) == (14, 12_845_056));
    }
}
