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
//! | `gie_config` | YAML | GIE's `EndpointPickerConfig` (`--config-file`) onto a picker config: plugin mapping, `kvroute-picker` parameters, weights, validation |
//! | `agent_token` | byte 0 picks what the API says of the token's pod; a line with the `authorization` value an agent sends, then the TokenReview the API server answers (JSON) | bearer-token parsing, the `exp` claim, the picker's TokenReview checks and its cache |
//! | `kube_objects` | byte 0 picks: an InferencePool, EndpointSlices, InferenceModelRewrites and InferenceObjectives (JSON, as the API server sends them), or a kubelet PodResources `List` answer (protobuf) | the pool spec view, the picker replicas and peers, the model table, the pods' GPUs |
//! | `replica_messages` | length-delimited protobuf `ReplicaMessage`s | a peer replica's stream: message checks, then its events applied to the pending table and peers' in-flight counts |
//! | `response_usage` | byte 0 picks the `content-type` and the chunk size; the rest is an engine's response body | the usage scanner (`cached_tokens`, `completion_tokens`), whose answer must not depend on the chunking |
//! | `image_headers` | byte 0 picks: image bytes, or a `data:` URL | inline-image header readers (PNG, JPEG, WebP, GIF, BMP), strict base64, the Qwen2-VL token count |

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
    ("gie_config", gie_config),
    ("agent_token", agent_token),
    ("kube_objects", kube_objects),
    ("replica_messages", replica_messages),
    ("response_usage", response_usage),
    ("image_headers", image_headers),
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

/// GIE's `EndpointPickerConfig` file (or a kvroute picker config passed as `--config-file`), read
/// as the picker does at start: mapped onto a picker config, then validated.
pub fn gie_config(data: &[u8]) {
    let path = std::path::Path::new("/etc/epp/config.yaml");
    let Ok((config, _warnings)) = kvroute_picker::gie::load_from(None, Some((path, data))) else { return };
    if config.validate().is_ok() {
        let w = &config.scoring.weights;
        let sum = w.cache + w.load + w.queue + w.adapter + w.health;
        assert!(sum.is_finite(), "weights of a valid config sum to {sum}");
        let _ = config.pool_source();
        let _ = config.pool();
    }
}

/// What the API server says of one agent token: `status` (`None`: the API did not answer) and
/// the pod read for it.
struct FakeReview {
    status: Option<k8s_openapi::api::authentication::v1::TokenReviewStatus>,
    pod: Option<(String, Option<String>)>,
}

#[tonic::async_trait]
impl kvroute_picker::ingest::token::ReviewApi for FakeReview {
    async fn review(
        &self,
        _token: &str,
        _audience: &str,
    ) -> Result<k8s_openapi::api::authentication::v1::TokenReviewStatus, String> {
        self.status.clone().ok_or_else(|| "no answer".to_string())
    }

    async fn pod(&self, _namespace: &str, _name: &str) -> Result<Option<(String, Option<String>)>, String> {
        Ok(self.pod.clone())
    }
}

/// URL-safe base64 without padding, as a JWT's segments are written.
pub fn base64_url(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = c.iter().enumerate().fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..=c.len() {
            out.push(char::from(A[(n >> (18 - 6 * i) & 63) as usize]));
        }
    }
    out
}

/// Agent token identity: the first line is the `authorization` metadata value of an agent's
/// `Report` stream, the rest the TokenReview object the API server answers (JSON). Byte 0 picks
/// the pod the API reads for it (bits 0-1: none, one with the review's pod-uid on `node-a`, one
/// with another uid, one not scheduled yet) and whether the token's middle segment is its claims
/// in the clear, encoded here so that mutations reach the claims themselves (bit 2). The token is
/// verified twice (the second may come from the cache); an accepted one names a pod, its uid and
/// a node.
pub fn agent_token(data: &[u8]) {
    use kvroute_picker::ingest::token::{AgentTokenConfig, POD_UID_KEY, TokenVerifier, bearer, token_expiry};
    let Some((&sel, rest)) = data.split_first() else { return };
    let (header, review) = match rest.iter().position(|&b| b == b'\n') {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, &[][..]),
    };
    let Ok(value) = tonic::metadata::MetadataValue::try_from(header) else { return };
    let mut metadata = tonic::metadata::MetadataMap::new();
    metadata.insert("authorization", value);
    let Some(token) = bearer(&metadata) else { return };
    let encoded;
    let token = if sel & 4 == 0 {
        token
    } else {
        let mut parts = token.splitn(3, '.');
        let (head, claims, sig) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        encoded = format!("{head}.{}.{sig}", base64_url(claims.as_bytes()));
        encoded.as_str()
    };
    let _ = token_expiry(token);
    let status = serde_json::from_slice::<k8s_openapi::api::authentication::v1::TokenReview>(review)
        .ok()
        .map(|r| r.status.unwrap_or_default());
    let uid = status
        .as_ref()
        .and_then(|s| s.user.as_ref()?.extra.as_ref()?.get(POD_UID_KEY)?.first().cloned())
        .unwrap_or_default();
    let pod = match sel & 3 {
        0 => None,
        1 => Some((uid, Some("node-a".to_string()))),
        2 => Some((format!("{uid}-other"), Some("node-a".to_string()))),
        _ => Some((uid, None)),
    };
    let config = AgentTokenConfig { cache_entries: 2, ..AgentTokenConfig::default() };
    let verifier = TokenVerifier::new(std::sync::Arc::new(FakeReview { status, pod }), &config, "kvroute-system");
    runtime().block_on(async {
        let first = verifier.verify(token).await;
        if let Ok(p) = &first {
            assert!(!p.pod.is_empty() && !p.uid.is_empty() && !p.node.is_empty(), "accepted {p:?}");
            assert_eq!(p.namespace, "kvroute-system");
        }
        let second = verifier.verify(token).await;
        assert_eq!(first.is_ok(), second.is_ok(), "a token verified twice gets one answer");
        assert!(verifier.cached() <= 2, "{} reviews cached, at most 2", verifier.cached());
    });
}

/// Kubernetes objects the picker and the agent read from the API: byte 0 picks an InferencePool
/// (0), EndpointSlices (1: a slice or an array of them; bit 2 picks the port by name `ingest`),
/// InferenceModelRewrites and InferenceObjectives (2: an array, told apart by `kind`) or a kubelet
/// PodResources `List` answer (3, protobuf); the rest is the input.
pub fn kube_objects(data: &[u8]) {
    use kvroute_cluster::crd::{InferenceModelRewrite, InferenceObjective, InferencePool};
    use kvroute_cluster::{ModelTable, NodeGpus, PoolSpecView, ReplicaView, Source};
    let Some((&sel, rest)) = data.split_first() else { return };
    match sel & 3 {
        0 => {
            let Ok(pool) = serde_json::from_slice::<InferencePool>(rest) else { return };
            let spec = PoolSpecView::from_spec(&pool.spec);
            let ports = &spec.target_ports;
            assert!(ports.len() <= kvroute_cluster::pool::MAX_TARGET_PORTS, "{} target ports", ports.len());
            assert!(ports.iter().all(|p| *p != 0), "port 0 in {ports:?}");
            assert!(ports.iter().enumerate().all(|(i, p)| !ports[..i].contains(p)), "repeated port in {ports:?}");
            assert!(spec.selects(&spec.selector), "a pool selects its own labels");
            let _ = spec.label_selector();
        }
        1 => {
            use k8s_openapi::api::discovery::v1::EndpointSlice;
            let slices = match serde_json::from_slice::<Vec<EndpointSlice>>(rest) {
                Ok(s) => s,
                Err(_) => match serde_json::from_slice::<EndpointSlice>(rest) {
                    Ok(s) => vec![s],
                    Err(_) => return,
                },
            };
            let port = (sel & 4 != 0).then_some("ingest");
            let replicas = kvroute_cluster::replicas::replicas_from_slices(&slices, port);
            assert!(replicas.len() <= kvroute_cluster::replicas::MAX_REPLICAS, "{} replicas", replicas.len());
            assert!(replicas.windows(2).all(|w| w[0].addr < w[1].addr), "replicas sorted and unique by address");
            assert!(replicas.iter().all(|r| r.addr.port() != 0), "a replica on port 0");
            let own = replicas.first().map(|r| r.addr);
            let view = ReplicaView { service: "kvroute-picker".into(), replicas, synced: true, generation: 1 };
            let peers = kvroute_picker::replicas::peers_in_view(&view, own.as_slice(), None);
            assert!(own.is_none_or(|a| !peers.contains(&a)), "a replica follows itself");
        }
        2 => {
            let Ok(objects) = serde_json::from_slice::<Vec<serde_json::Value>>(rest) else { return };
            let (mut rewrites, mut objectives) = (Vec::new(), Vec::new());
            for o in objects {
                if o.get("kind").and_then(serde_json::Value::as_str) == Some("InferenceObjective") {
                    objectives.extend(serde_json::from_value::<InferenceObjective>(o).ok());
                } else {
                    rewrites.extend(serde_json::from_value::<InferenceModelRewrite>(o).ok());
                }
            }
            let source = Source::Kubernetes { namespace: "default".into(), name: "pool".into() };
            let table = ModelTable::from_objects(source, "pool", &rewrites, &objectives, true);
            assert!(table.rules.len() <= kvroute_cluster::models::MAX_RULES, "{} rules", table.rules.len());
            for rule in &table.rules {
                assert!(!rule.targets.is_empty(), "a rule without a target");
                assert!(rule.targets.len() <= kvroute_cluster::models::MAX_TARGETS, "{} targets", rule.targets.len());
                assert!(
                    rule.targets
                        .iter()
                        .filter_map(|t| t.weight)
                        .all(|w| (1..=kvroute_cluster::models::MAX_WEIGHT).contains(&w)),
                    "a weight out of range"
                );
                for r in [0, 1, u64::MAX / 3, u64::MAX] {
                    assert!(rule.pick(r).is_some(), "a rule with targets picks one");
                }
                for m in &rule.matches {
                    assert!(table.rule_for(m).is_some(), "model {m:?} has a rule");
                }
            }
        }
        _ => {
            use prost::Message;
            let Ok(list) = kvroute_cluster::podresources::proto::ListPodResourcesResponse::decode(rest) else { return };
            let gpus = NodeGpus::from_list(&list);
            for ((namespace, pod), g) in &gpus.pods {
                assert!(!g.is_empty(), "a pod listed without GPUs");
                assert_eq!(gpus.of_pod(namespace, pod, None).len(), g.len());
            }
        }
    }
}

/// One peer replica's `ReplicaSync` stream: protobuf `ReplicaMessage`s, each prefixed with its
/// varint length, checked as the picker does and applied to a pending table (chains of at most
/// 4096 blocks kept) whose pods are `pod-0` to `pod-3`; the peer then leaves.
pub fn replica_messages(data: &[u8]) {
    use kvroute_picker::pending::{ManualClock, SharedView};
    use kvroute_picker::replicas::{MAX_EVENT_BLOCKS, MAX_POD_NAME_BYTES, from_message};
    use kvroute_proto::replica::v1::ReplicaMessage;
    use prost::Message;
    const NOW_MS: i64 = 1_800_000_000_000;
    let view = SharedView::new(30_000, 4096, std::sync::Arc::new(ManualClock::new(NOW_MS)));
    let resolve = |pod: &str| match pod {
        "pod-0" => Some(kvroute_picker::index::PodIdx(0)),
        "pod-1" => Some(kvroute_picker::index::PodIdx(1)),
        "pod-2" => Some(kvroute_picker::index::PodIdx(2)),
        "pod-3" => Some(kvroute_picker::index::PodIdx(3)),
        _ => None,
    };
    let origin = 7;
    let mut buf = data;
    while !buf.is_empty() {
        let Ok(m) = ReplicaMessage::decode_length_delimited(&mut buf) else { break };
        let Ok(Some(ev)) = from_message(m) else { continue };
        use kvroute_picker::pending::ReplicaEvent;
        let pod = match &ev {
            ReplicaEvent::Routed { pod, blocks, .. } => {
                assert!(blocks.len() <= MAX_EVENT_BLOCKS, "chain of {}", blocks.len());
                pod
            }
            ReplicaEvent::Finished { pod, .. } | ReplicaEvent::Unreachable { pod } => pod,
        };
        assert!(!pod.is_empty() && pod.len() <= MAX_POD_NAME_BYTES, "pod name of {} bytes", pod.len());
        let _ = view.apply_peer(origin, &ev, resolve);
        let st = view.lock();
        for p in 0..4 {
            let _ = st.peers.since(kvroute_picker::index::PodIdx(p), NOW_MS - 60_000);
        }
    }
    view.peer_gone(origin);
    assert!(view.lock().peers.is_empty(), "a peer's in-flight requests outlive its stream");
}

/// An engine's response body as the picker's ext_proc sees it: byte 0 picks the `content-type`
/// (bits 0-1: unknown, JSON, event stream) and the chunk size (bits 2-7: 1 to 64 bytes); the rest
/// is the body. Chunked or whole, the scanner finds the same counts.
pub fn response_usage(data: &[u8]) {
    use kvroute_picker::ext_proc::usage::UsageScanner;
    let Some((&sel, body)) = data.split_first() else { return };
    let event_stream = match sel & 3 {
        1 => Some(false),
        2 => Some(true),
        _ => None,
    };
    let chunk = usize::from(sel >> 2) + 1;
    let mut whole = UsageScanner::new(event_stream);
    whole.push(body);
    let whole_found = whole.finish();
    let mut chunked = UsageScanner::new(event_stream);
    for c in body.chunks(chunk) {
        chunked.push(c);
    }
    let chunked_found = chunked.finish();
    assert_eq!(whole_found, chunked_found, "cached_tokens whole and in chunks of {chunk}");
    assert_eq!(
        whole.completion_tokens(),
        chunked.completion_tokens(),
        "completion_tokens whole and in chunks of {chunk}"
    );
}

/// Inline images: byte 0 picks the input (bit 0: 0 the image's bytes, 1 a `data:` URL whose
/// payload is decoded, at most 64 KiB); the size read from the header is turned into the
/// Qwen2-VL token count and the image's content identifier.
pub fn image_headers(data: &[u8]) {
    use kvroute_common::image::{SmartResize, content_identifier, data_url_payload, decode_base64, image_size};
    let Some((&sel, rest)) = data.split_first() else { return };
    let decoded;
    let bytes = if sel & 1 == 0 {
        rest
    } else {
        let Ok(url) = std::str::from_utf8(rest) else { return };
        let Some(payload) = data_url_payload(url) else { return };
        let Some(b) = decode_base64(payload, 64 * 1024) else { return };
        assert!(b.len() <= 64 * 1024, "decoded {} bytes", b.len());
        decoded = b;
        &decoded
    };
    let Some((w, h)) = image_size(bytes) else { return };
    assert!(w > 0 && h > 0, "size {w}x{h}");
    let q = SmartResize::QWEN2_VL;
    if let Some((rh, rw)) = q.resize(w, h) {
        let factor = u64::from(q.patch_size * q.merge_size);
        assert!(rh > 0 && rw > 0 && rh % factor == 0 && rw % factor == 0, "resized to {rh}x{rw}");
        assert!(q.tokens(w, h).is_some_and(|t| t > 0), "{w}x{h} sized but no tokens");
    }
    assert_eq!(content_identifier("m", bytes).len(), 64);
}
