//! The fuzz targets: one plain function per parser of outside input, taking the fuzzer's bytes.
//! `fuzz/` (cargo fuzz, libFuzzer, its own target directory, outside the workspace) calls them;
//! `tests/replay.rs` feeds them every file of `fuzz/corpus/<target>/` (committed: seeds and the
//! minimised corpus), `fuzz/regressions/<target>/` (committed: one input per finding fixed) and
//! `fuzz/artifacts/<target>/` (the fuzzer's raw findings, local and not committed) under plain
//! `cargo test`, so the corpus and
//! every crash found stay regression tests without a nightly toolchain. `scripts/fuzz` runs each
//! target.
//!
//! A target fails by panicking (the fuzzer reports it as a crash), by not returning (a hang) or
//! by growing memory past the fuzzer's limit; every parser must instead return an error. Where a
//! parsed value has an invariant the rest of the system relies on, the target asserts it.
//!
//! | target | input | drives |
//! | --- | --- | --- |
//! | `ext_proc_body` | byte 0 picks the `:path` and the model, the rest is the request body | the picker's body parser (every OpenAI shape), approximate text chains, tokenization |
//! | `chat_template` | a JSON chat request (`messages`, `tools`) or a bare messages array | the chat template (minijinja) and tokenizer of the Qwen2.5 fixture |
//! | `kv_events` | byte 0 picks the framing, then 8 bytes of seq, then the msgpack payload | the agent's KV-event decoder and its block record |
//! | `prometheus` | a `/metrics` page | the agent's Prometheus text parser |
//! | `agent_messages` | length-delimited protobuf `AgentMessage`s | proto decoding and the picker's ingest of one agent stream into a fresh pool |
//! | `picker_config` | YAML | the picker's config parser and validation |
//! | `agent_config` | YAML | the agent's config parser, validation and source resolution |
//! | `cluster_inputs` | byte 0 picks: a pool file, an engine file (YAML), or a Kubernetes Pod (JSON, as the API server sends it) | the pool and engine file parsers and views, the pod's pool facts and its engines (vLLM argv, `--kv-events-config`, env expansion, KV endpoints) |

use std::sync::OnceLock;

use kvroute_agent::engine::blocks::BlockRecord;
use kvroute_agent::engine::kv_events::{ReplayFrame, decode_batch, decode_message, decode_replay};
use kvroute_agent::engine::metrics::{parse_engine_metrics, parse_samples};
use kvroute_picker::config::ModelConfig;
use kvroute_picker::model::ModelRegistry;
use kvroute_picker::pool::{Pool, PoolConfig};
use kvroute_picker::request::{PromptInput, parse_body};
use kvroute_proto::agent::v1::AgentMessage;
use kvroute_tokenize::{ChatRequest, ModelTokenizer};

/// A target: a name (its folder under `fuzz/corpus/` and `fuzz/artifacts/`) and its function.
pub type Target = (&'static str, fn(&[u8]));

/// Every target.
pub const TARGETS: &[Target] = &[
    ("ext_proc_body", ext_proc_body),
    ("chat_template", chat_template),
    ("kv_events", kv_events),
    ("prometheus", prometheus),
    ("agent_messages", agent_messages),
    ("picker_config", picker_config),
    ("agent_config", agent_config),
    ("cluster_inputs", cluster_inputs),
];

/// The tokenizer fixture (a real 151k-vocabulary BPE with Qwen's ChatML template).
fn tokenizer_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizer-qwen2.5")
}

/// Models of the ext_proc target: `qwen` (precise, the fixture's tokenizer, 40 tokens per
/// image), `vl` (the same with `vision`: inline images sized and hashed), `approx` (approximate
/// text blocks) and `lora` (an adapter on `approx`).
fn registry() -> &'static ModelRegistry {
    static REGISTRY: OnceLock<ModelRegistry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let mut qwen = ModelConfig::named("qwen");
        qwen.tokenizer = Some(tokenizer_dir());
        qwen.image_tokens = Some(40);
        let mut vl = ModelConfig::named("vl");
        vl.tokenizer = Some(tokenizer_dir());
        let q = kvroute_common::image::SmartResize::QWEN2_VL;
        vl.vision = Some(kvroute_picker::config::VisionConfig {
            patch_size: q.patch_size,
            merge_size: q.merge_size,
            min_pixels: q.min_pixels,
            max_pixels: q.max_pixels,
        });
        let mut lora = ModelConfig::named("lora");
        lora.target_model = Some("approx".into());
        lora.adapter = Some("sql-lora".into());
        ModelRegistry::load(&[qwen, ModelConfig::named("approx"), lora, vl], 16)
    })
}

fn tokenizer() -> Option<&'static ModelTokenizer> {
    static TOKENIZER: OnceLock<Option<ModelTokenizer>> = OnceLock::new();
    TOKENIZER.get_or_init(|| ModelTokenizer::from_dir(&tokenizer_dir()).ok()).as_ref()
}

/// ext_proc request bodies: byte 0 picks the `:path` (low 2 bits) and the model used when the
/// body names none that is configured (bits 2-3); the rest is the body.
pub fn ext_proc_body(data: &[u8]) {
    let Some((&sel, body)) = data.split_first() else { return };
    const PATHS: [&str; 4] = ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/chat/completions?x=1"];
    const MODELS: [&str; 4] = ["qwen", "approx", "lora", "vl"];
    let path = PATHS[usize::from(sel & 3)];
    let Ok(parsed) = parse_body(path, body) else { return };
    assert!(!parsed.model.is_empty(), "a parsed body names a model");
    let reg = registry();
    let Some(model) = reg.resolve(&parsed.model).or_else(|| reg.resolve(MODELS[usize::from((sel >> 2) & 3)])) else {
        return;
    };
    let (mut codepoints, mut chain) = (Vec::new(), Vec::new());
    if model.approx_chain(&parsed.prompt, &mut codepoints, &mut chain) {
        assert!(chain.len() <= kvroute_picker::approx::DEFAULT_MAX_BLOCKS, "chain of {} blocks", chain.len());
    }
    // The chat bounds (limits.max_messages and the rest), small enough for inputs to cross.
    if let PromptInput::Chat(chat) = &parsed.prompt {
        use kvroute_picker::request::{ChatBounds, ModelError, check_chat};
        let bounds = ChatBounds { max_messages: 8, max_content_parts: 16, max_tools: 4 };
        match check_chat(chat, &bounds) {
            Ok(()) => assert!(chat.messages.len() <= 8 && chat.tools.as_ref().map_or(0, Vec::len) <= 4),
            Err(ModelError::TooLarge { limit, got, .. }) => assert!(got > limit, "{got} over {limit}"),
            Err(e) => panic!("check_chat fails only with TooLarge: {e}"),
        }
    }
    let tokens = model.tokens(&parsed.prompt, "fuzz");
    if let PromptInput::Tokens(t) = &parsed.prompt {
        assert_eq!(&tokens, t, "token prompts pass through");
    }
    let mut hashes = Vec::new();
    model.hasher.hash_prompt(&tokens, &mut hashes);
    assert_eq!(hashes.len(), tokens.len() / 16);
    // Images (docs/design.md §2): placed items lie inside the expanded prompt, before what may
    // be claimed, in order; the keyed chain covers the claimable prefix's full blocks.
    if let PromptInput::Chat(chat) = &parsed.prompt
        && let Ok(images) = kvroute_picker::request::chat_images(&chat.messages)
    {
        let mut expanded = tokens.clone();
        if let Ok(p) = model.place_images(&images, &mut expanded) {
            assert!(p.claimable <= expanded.len() && p.items.len() <= images.len());
            assert!(p.items.iter().all(|i| i.offset + i.length <= p.claimable));
            assert!(p.items.windows(2).all(|w| w[0].offset + w[0].length <= w[1].offset));
            let keys = kvroute_common::BlockKeys { cache_salt: None, items: p.items };
            model.hasher.hash_prompt_keyed(&expanded[..p.claimable], &keys, &mut hashes);
            assert_eq!(hashes.len(), p.claimable / 16);
        }
    }
}

/// Chat-template inputs: a JSON object with `messages` (and `tools`), or a bare messages array,
/// rendered with the fixture's template and tokenized.
pub fn chat_template(data: &[u8]) {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    let chat = match v {
        serde_json::Value::Array(messages) => ChatRequest { messages, tools: None },
        other => match serde_json::from_value::<ChatRequest>(other) {
            Ok(c) => c,
            Err(_) => return,
        },
    };
    let Some(t) = tokenizer() else { return };
    if let Ok(text) = t.render_chat(&chat) {
        let ids = t.encode_chat(&chat).unwrap_or_default();
        assert!(text.is_empty() || !ids.is_empty(), "a rendered chat tokenizes to something");
    }
}

/// KV-event messages: byte 0 picks the framing (0: SUB `[topic, seq, payload]`; 1: replay
/// `["", topic, seq, payload]`; 2: older replay `["", seq, payload]`; 3: the payload alone),
/// bytes 1..9 are the seq; the rest is the msgpack payload. A decoded batch is applied twice to
/// a small block record, whose changes and snapshot must stay consistent.
pub fn kv_events(data: &[u8]) {
    let Some((&sel, rest)) = data.split_first() else { return };
    if rest.len() < 8 {
        let _ = decode_batch(rest);
        return;
    }
    let (seq, payload) = rest.split_at(8);
    let (seq, payload) = (seq.to_vec(), payload.to_vec());
    let topic = b"kv@10.0.0.1@m".to_vec();
    let batch = match sel & 3 {
        0 => decode_message(&[topic, seq, payload]).ok().map(|m| m.batch),
        1 => match decode_replay(&[Vec::new(), topic, seq, payload]) {
            Ok(ReplayFrame::Batch(m)) => Some(m.batch),
            _ => None,
        },
        2 => match decode_replay(&[Vec::new(), seq, payload]) {
            Ok(ReplayFrame::Batch(m)) => Some(m.batch),
            _ => None,
        },
        _ => decode_batch(&payload).ok(),
    };
    let Some(batch) = batch else { return };
    let mut rec = BlockRecord::new("m", kvroute_common::DEFAULT_BLOCK_SIZE as u32);
    rec.set_capacity(1024);
    rec.apply(&batch);
    rec.apply(&batch);
    assert!(rec.len() <= 1024, "record over its capacity: {}", rec.len());
    let changes = rec.take_changes();
    let stored: Vec<u64> = changes.stored.iter().flat_map(|r| r.hashes.iter().copied()).collect();
    for h in &stored {
        assert!(!changes.removed.contains(h), "block {h} both stored and removed");
        assert!(rec.contains(kvroute_common::BlockHash(*h)), "stored block {h} not held");
    }
    let snap: usize = rec.snapshot_runs().iter().map(|r| r.hashes.len()).sum();
    assert_eq!(snap, rec.gpu_len(), "a snapshot names each GPU block once");
}

/// `/metrics` pages (any bytes, read as UTF-8 lossily, as the agent does).
pub fn prometheus(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Ok(m) = parse_engine_metrics(&text) {
        assert!((0.0..=1.0).contains(&m.kv_cache_usage), "kv_cache_usage {}", m.kv_cache_usage);
    }
    let _ = parse_samples(&text);
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    #[allow(clippy::expect_used)] // The fuzz process cannot run without it.
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime"))
}

/// One agent stream: protobuf `AgentMessage`s, each prefixed with its varint length, handled by
/// the picker's ingest into a fresh pool (blocks per pod capped at 4096), then the stream ends.
pub fn agent_messages(data: &[u8]) {
    use prost::Message;
    let mut messages = Vec::new();
    let mut buf = data;
    while !buf.is_empty() {
        match AgentMessage::decode_length_delimited(&mut buf) {
            Ok(m) => messages.push(m),
            Err(_) => break,
        }
    }
    if messages.is_empty() {
        return;
    }
    runtime().block_on(async move {
        let pool = Pool::new(PoolConfig { max_blocks_per_pod: 4096, ..PoolConfig::default() });
        let mut stream = kvroute_picker::ingest::StreamDriver::new(pool.clone());
        for m in messages {
            if stream.feed(m).await.is_err() {
                return;
            }
        }
        let _ = stream.end().await;
        if pool.sync().await.is_ok() {
            for p in pool.pods() {
                assert!(p.blocks <= 4096, "pod {} holds {} blocks", p.name, p.blocks);
            }
            let _ = pool.index_stats();
        }
    });
}

/// The picker's config file.
pub fn picker_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(c) = kvroute_picker::config::PickerConfig::from_yaml(text)
        && c.validate().is_ok()
    {
        let _ = c.pool();
    }
}

/// The agent's config file.
pub fn agent_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(c) = serde_norway::from_str::<kvroute_agent::config::AgentConfig>(text)
        && c.validate().is_ok()
    {
        let _ = c.picker_source();
        // A `pool:` source reads the namespace from the environment only; nothing is dialled.
        let _ = c.engine_source();
    }
}

/// What the cluster tells the agent and the picker: byte 0 picks a pool file (0), an engine file
/// (1) or a Pod object as JSON (2, 3: with the target ports 8000 and 8001); the rest is the input.
pub fn cluster_inputs(data: &[u8]) {
    use kvroute_cluster::engine::engines_of;
    use kvroute_cluster::file::{EngineFile, PoolFile};
    use kvroute_cluster::{PoolPod, PoolSpecView};
    let Some((&sel, rest)) = data.split_first() else { return };
    let path = std::path::Path::new("fuzz.yaml");
    match sel & 3 {
        0 => {
            if let Ok(f) = PoolFile::parse(path, rest) {
                let view = f.pool_view(path);
                let _ = view.candidates().count();
                let _ = f.model_table(path);
            }
        }
        1 => {
            if let Ok(f) = EngineFile::parse(path, rest) {
                let view = f.node_view(path, "node-a");
                let mut names: Vec<&str> = view.engines.iter().map(|e| e.endpoint.as_str()).collect();
                names.sort_unstable();
                let n = names.len();
                names.dedup();
                assert_eq!(n, names.len(), "engine names are unique");
            }
        }
        _ => {
            let Ok(pod) = serde_json::from_slice::<k8s_openapi::api::core::v1::Pod>(rest) else { return };
            let spec =
                PoolSpecView { target_ports: vec![8000, 8001], app_protocol: "http".into(), ..Default::default() };
            let Some(pool_pod) = PoolPod::from_pod(&pod, &spec) else { return };
            assert!(pool_pod.ports.len() <= spec.target_ports.len(), "ports {:?}", pool_pod.ports);
            for e in engines_of(&pod, &pool_pod) {
                assert!(!e.endpoint.is_empty(), "an engine has a name");
            }
        }
    }
}
