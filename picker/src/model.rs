//! InferenceModel resolution and prompt → token ids → block hashes.
//!
//! A request's `model` names an InferenceModel from the config; it resolves to the base model the
//! pods serve (`target_model`) and an optional LoRA adapter. Each model has a `BlockHasher` rooted at
//! (target_model, adapter) (docs/design.md §2) and, when configured, a tokenizer shared by every model that
//! names the same directory.
//!
//! Prompts (parsed from the body by [`crate::request`]): completions text → `encode_prompt`;
//! token ids → as is; chat messages (+ `tools`) → `encode_chat`. A tokenizer failure yields no
//! tokens and a warning: the request is then routed by load alone. A request's `cache_salt`
//! enters its block hashes as vLLM's does (on the first block, docs/design.md §2), so a salted
//! prompt matches only blocks its own salt built; approximate mode does not match salted prompts
//! (its text chains carry no salt).
//!
//! Images in chat messages (docs/design.md §2): the engine expands each image's placeholder token
//! to the image's token count and keys the blocks those tokens cover with the image's identifier.
//! [`ResolvedModel::place_images`] does the same where it can: the identifier is the image's
//! `uuid` (vLLM's `multi_modal_uuids`) or, for an inline `data:` URL, vLLM's content hash of its
//! bytes; the count is the model's fixed `image_tokens` or, with `vision`, the Qwen2-VL count of
//! the image's size read from its header. From the first image it cannot place on (an http(s) URL
//! without `uuid`, a count it cannot know, malformed data, an inline image whose identifier is
//! not read yet), no block is claimed; every image whose count is known is still expanded.
//!
//! An inline image not read before is sized from its header alone and its identifier read in the
//! background ([`ResolvedModel::read_later`], docs/decisions/0049-image-identifier-off-the-decision.md):
//! the decision does not wait for a decode and hash of the whole image, and the next request
//! that sends the image (a chat's next turn) finds its identifier in the model's [`ImageCache`].
//!
//! Mode (docs/design.md §6): precise models hash token blocks and match the KV-event index; approximate
//! models (default without a tokenizer, or when it fails to load) hash text blocks
//! ([`crate::approx`]) and match the [`ApproxStore`] of their base model, shared by every model
//! with the same `target_model` (a pod's cache holds all its adapters' blocks; the per-pod bound
//! and block settings are those of the first such model).
//!
//! Concurrency: the registry is immutable after start-up and shared by `Arc`; tokenization is
//! CPU-bound and is run by callers off the async workers (`block_in_place` / `spawn_blocking`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, OnceLock};

use kvroute_common::image::{InlineImage, SmartResize, data_url_payload, inline_image, inline_image_size, payload_key};
use kvroute_common::{BlockHash, BlockHasher, MmItem};
use kvroute_tokenize::ModelTokenizer;
use std::sync::atomic::AtomicBool;

use crate::approx::{ApproxStore, RoutingMode, TextHasher, prompt_text};
use crate::config::{DEFAULT_IMAGE_PLACEHOLDER, ModelConfig};
use crate::request::{ChatImage, PromptInput};

/// A configured model, ready to hash requests.
#[derive(Debug)]
pub struct ResolvedModel {
    /// Client-facing name.
    pub name: String,
    /// Base model served by the pods.
    pub target_model: String,
    /// LoRA adapter, if any.
    pub adapter: Option<String>,
    /// Tokenizer; `None` when not configured or it failed to load (load-only routing).
    pub tokenizer: Option<Arc<ModelTokenizer>>,
    /// Block hasher rooted at (target_model, adapter).
    pub hasher: BlockHasher,
    /// Approximate mode's text hasher and store; `None` in precise mode.
    pub approx: Option<ApproxModel>,
    /// How images become placeholder tokens (docs/design.md §2).
    pub images: ImageSettings,
    /// Inline images this model read lately (an image sent again is not decoded again); shared
    /// with the background reader ([`ResolvedModel::read_later`]).
    pub image_cache: Arc<ImageCache>,
}

/// How a model's chat template and engine turn an image into tokens (docs/design.md §2).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageSettings {
    /// Id of the token the chat template renders once per image (`image_placeholder`); `None`
    /// when the tokenizer has no such token (then no block from the first image on is claimed,
    /// and with it nothing: the picker cannot tell where the image is).
    pub placeholder: Option<u32>,
    /// Placeholder tokens per image on the engine (`image_tokens`); `None` when not fixed.
    pub tokens_per_image: Option<usize>,
    /// The count from the image's size (`vision`), when not fixed.
    pub vision: Option<SmartResize>,
    /// The model id vLLM folds into an inline image's content hash (`image_hash_model`, default
    /// the base model).
    pub hash_model: String,
}

/// Largest inline image the picker decodes, in bytes; a larger one is treated as one it cannot
/// reproduce (its blocks are not claimed). The body limit bounds every image anyway.
pub const MAX_INLINE_IMAGE_BYTES: usize = 64 << 20;

/// Entries per generation of an [`ImageCache`] (two generations: at most twice as many images,
/// ≈ 150 bytes each).
pub const IMAGE_CACHE_ENTRIES: usize = 1024;

/// Payloads shorter than this (bytes of base64) are read without the cache: little to save.
const IMAGE_CACHE_MIN_PAYLOAD: usize = 16 * 1024;

/// Payloads shorter than this (bytes of base64, ≈ 48 KB of image) are read whole by the decision
/// when not cached, ≈ 25 µs each; a longer one is sized from its header and read in the
/// background.
pub const IMAGE_READ_NOW_MAX_PAYLOAD: usize = 64 * 1024;

/// The inline images a model read lately: size and identifier by [`payload_key`] (BLAKE3 of the
/// base64 payload), so an image sent again, as every turn of a chat resends its earlier images,
/// costs one hash of its payload instead of a base64 decode and a hash of its bytes
/// (docs/decisions/0048-inline-image-cache.md). A hit is what reading the payload again would
/// give: the answer is a function of the payload and the model's `hash_model` only, and only
/// images read successfully are kept.
///
/// Bounded: two generations of at most [`IMAGE_CACHE_ENTRIES`]; when the newer one is full it
/// becomes the older and the older is dropped, and a hit in the older is copied to the newer.
/// The lock is held for the map operations only, never while an image is read.
#[derive(Debug, Default)]
pub struct ImageCache {
    generations: parking_lot::Mutex<[HashMap<[u8; 32], InlineImage>; 2]>,
}

impl ImageCache {
    /// What a decision reads of an inline image: its size and, when `model_id` asks for one, its
    /// identifier if it is at hand. Without `model_id`: the size from the header alone
    /// ([`inline_image_size`]). With it: a payload read before answers from the cache; one under
    /// [`IMAGE_READ_NOW_MAX_PAYLOAD`] is read whole ([`ImageCache::read`]); any other is sized
    /// from its header and returned without identifier, with its [`payload_key`] as the second
    /// value (its read is to be handed to [`ResolvedModel::read_later`]). `None` where the header is refused, as
    /// [`inline_image`] refuses it. Work: the header's piece of the payload, plus one BLAKE3
    /// pass over the payload's text with `model_id`; never a decode of the whole image.
    pub fn lookup(&self, payload: &str, model_id: Option<&str>) -> Option<(InlineImage, Option<[u8; 32]>)> {
        let Some(model_id) = model_id else {
            let size = inline_image_size(payload, MAX_INLINE_IMAGE_BYTES)?;
            return Some((InlineImage { size, identifier: None }, None));
        };
        if payload.len() < IMAGE_READ_NOW_MAX_PAYLOAD {
            return Some((self.read(payload, Some(model_id))?, None));
        }
        let key = payload_key(payload);
        if let Some(hit) = self.get(&key, true) {
            return Some((hit, None));
        }
        let size = inline_image_size(payload, MAX_INLINE_IMAGE_BYTES)?;
        Some((InlineImage { size, identifier: None }, Some(key)))
    }

    /// The image kept under `key` (with an identifier when `identified`), refreshed in the newer
    /// generation.
    fn get(&self, key: &[u8; 32], identified: bool) -> Option<InlineImage> {
        let usable = |i: &&InlineImage| !identified || i.identifier.is_some();
        let hit = {
            let g = self.generations.lock();
            let [newer, older] = &*g;
            match newer.get(key).filter(usable) {
                Some(hit) => Some(hit.clone()),
                None => older.get(key).filter(usable).cloned(),
            }
        }?;
        self.keep(*key, &hit);
        Some(hit)
    }

    /// `inline_image(payload, model_id, MAX_INLINE_IMAGE_BYTES)`, from the cache when this
    /// payload was read before (with an identifier, when `model_id` asks for one): the whole
    /// read, what the background reader runs.
    pub fn read(&self, payload: &str, model_id: Option<&str>) -> Option<InlineImage> {
        if payload.len() < IMAGE_CACHE_MIN_PAYLOAD {
            return inline_image(payload, model_id, MAX_INLINE_IMAGE_BYTES);
        }
        self.read_keyed(payload_key(payload), payload, model_id)
    }

    /// [`ImageCache::read`] of a payload whose [`payload_key`] is `key`, already computed (the
    /// background reader gets the key the decision's [`ImageCache::lookup`] computed).
    fn read_keyed(&self, key: [u8; 32], payload: &str, model_id: Option<&str>) -> Option<InlineImage> {
        if let Some(hit) = self.get(&key, model_id.is_some()) {
            return Some(hit);
        }
        let read = inline_image(payload, model_id, MAX_INLINE_IMAGE_BYTES)?;
        self.keep(key, &read);
        Some(read)
    }

    /// Images kept, both generations (for tests and metrics).
    pub fn len(&self) -> usize {
        let g = self.generations.lock();
        g[0].len() + g[1].len()
    }

    /// Whether no image is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn keep(&self, key: [u8; 32], image: &InlineImage) {
        let mut g = self.generations.lock();
        if g[0].contains_key(&key) && (image.identifier.is_none() || g[0][&key].identifier.is_some()) {
            return;
        }
        if g[0].len() >= IMAGE_CACHE_ENTRIES {
            g[1] = std::mem::take(&mut g[0]);
        }
        g[0].insert(key, image.clone());
    }
}

/// Reads queued for the background reader at most ([`ResolvedModel::read_later`]).
pub const IMAGE_READ_QUEUE: usize = 64;

/// Bytes of payload queued for the background reader at most (one 7 MB request of four 720p
/// images is ≈ 9.4 MB of base64): a read that would go past it is dropped.
pub const IMAGE_READ_QUEUE_BYTES: usize = 64 << 20;

/// One inline image to read in the background: its URL (moved out of the request), where the
/// payload starts in it, its [`payload_key`], and the cache and model id to read it for.
struct ImageJob {
    url: String,
    payload_at: usize,
    key: [u8; 32],
    cache: Arc<ImageCache>,
    hash_model: String,
}

/// The process's background image reader: one thread at a lower priority (nice + 10), fed by a
/// bounded queue ([`IMAGE_READ_QUEUE`] jobs, [`IMAGE_READ_QUEUE_BYTES`] bytes).
struct ImageReader {
    queue: SyncSender<ImageJob>,
    queued_bytes: Arc<AtomicUsize>,
}

/// The reader, started on first use; `None` when its thread could not be started.
fn image_reader() -> Option<&'static ImageReader> {
    static READER: OnceLock<Option<ImageReader>> = OnceLock::new();
    READER
        .get_or_init(|| {
            let (queue, jobs) = sync_channel(IMAGE_READ_QUEUE);
            let queued_bytes = Arc::new(AtomicUsize::new(0));
            let bytes = queued_bytes.clone();
            let started = std::thread::Builder::new()
                .name("kvroute-image-reader".into())
                .spawn(move || read_images(&jobs, &bytes));
            match started {
                Ok(_) => Some(ImageReader { queue, queued_bytes }),
                Err(e) => {
                    tracing::warn!(error = %e, "the background image reader did not start: new images are not read");
                    None
                }
            }
        })
        .as_ref()
}

/// The reader's loop: each job read whole into its model's cache, its bytes then released.
fn read_images(jobs: &Receiver<ImageJob>, queued_bytes: &AtomicUsize) {
    // Below the decisions: what it reads serves a later request, never the current one.
    let tid = rustix::thread::gettid();
    let nice = rustix::process::getpriority_process(Some(tid)).unwrap_or(0);
    if let Err(e) = rustix::process::setpriority_process(Some(tid), (nice + 10).min(19)) {
        tracing::debug!(error = %e, "the image reader keeps the process's priority");
    }
    for job in jobs {
        let payload = job.url.get(job.payload_at..).unwrap_or_default();
        job.cache.read_keyed(job.key, payload, Some(&job.hash_model));
        queued_bytes.fetch_sub(job.url.len(), Ordering::Relaxed);
    }
}

/// Most tokens a prompt may have once its images are expanded; images that would go past it are
/// not placed (their blocks are not claimed).
pub const MAX_EXPANDED_TOKENS: usize = 1 << 21;

/// An image's placement in a prompt: the images the picker reproduced as the engine keys them,
/// and how many leading tokens it may claim.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ImagePlacement {
    /// The reproduced images (identifier: the `uuid`, or the content hash of an inline image),
    /// in prompt order, in expanded token positions.
    pub items: Vec<MmItem>,
    /// Tokens from the start that the engine sees exactly as the picker does: up to the first
    /// placeholder of the first image not reproduced (the whole prompt when every image is).
    pub claimable: usize,
    /// Images sized from their header whose identifier is to be read in the background: their
    /// indices in the `images` given and their [`payload_key`]s, for
    /// [`ResolvedModel::read_later`].
    pub deferred: Vec<(usize, [u8; 32])>,
}

/// What [`ResolvedModel::reproduce_image`] knows of an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReproducedImage {
    /// Placeholder tokens the engine expands it to.
    pub tokens: usize,
    /// The identifier the engine keys its blocks with; `None` when not known (yet).
    pub identifier: Option<String>,
    /// An inline image sized from its header only, its identifier to be read in the background:
    /// the [`payload_key`] its decision computed.
    pub deferred: Option<[u8; 32]>,
}

/// A model in approximate mode: its text-chain hasher and the store of where chains went.
#[derive(Debug)]
pub struct ApproxModel {
    /// Text blocks chained from (target_model, adapter).
    pub hasher: TextHasher,
    /// Shared by every model with the same `target_model`.
    pub store: Arc<ApproxStore>,
}

/// Most (base model, adapter) targets resolved from rewrite rules that the registry keeps
/// ([`ModelRegistry::target`]); further ones are built per request and not kept. Targets come from
/// the InferenceModelRewrite objects and the engines' reports, never from a client's input.
pub const MAX_TARGET_MODELS: usize = 1024;

/// Every configured model by client-facing name, and the targets of rewrite rules
/// (docs/design.md §14) built on first use.
#[derive(Debug, Default)]
pub struct ModelRegistry {
    models: HashMap<String, Arc<ResolvedModel>>,
    /// A rewrite target's settings, by base model: the first `models[]` entry of that base model
    /// and its tokenizer (none: approximate mode with the default settings).
    templates: HashMap<String, (ModelConfig, Option<Arc<ModelTokenizer>>)>,
    block_size: usize,
    /// Approximate stores by base model, shared by configured models and rewrite targets.
    stores: parking_lot::Mutex<HashMap<String, Arc<ApproxStore>>>,
    /// Rewrite targets resolved so far, by (base model, adapter).
    targets: parking_lot::RwLock<HashMap<TargetKey, Arc<ResolvedModel>>>,
}

/// A rewrite target's (base model, adapter).
type TargetKey = (String, Option<String>);

impl ModelRegistry {
    /// Builds every model of the config. A tokenizer directory without `tokenizer.json` (the
    /// volume not mounted, or not filled yet) is logged once, in one line naming the models'
    /// mode, and its models route in approximate mode (unless `mode: precise`, which validation
    /// refuses for it); mounting the tokenizer there and restarting turns precise mode on. A
    /// tokenizer that is there but fails to load is logged too, with the same fallback.
    pub fn load(models: &[ModelConfig], block_size: usize) -> Self {
        let mut tokenizers: HashMap<PathBuf, Option<Arc<ModelTokenizer>>> = HashMap::new();
        let mut out = HashMap::new();
        let mut stores: HashMap<String, Arc<ApproxStore>> = HashMap::new();
        let mut templates = HashMap::new();
        for m in models {
            let tokenizer = m.tokenizer.as_ref().and_then(|dir| {
                tokenizers
                    .entry(dir.clone())
                    .or_insert_with(|| {
                        if !dir.join("tokenizer.json").is_file() {
                            tracing::warn!(model = %m.name, dir = %dir.display(),
                                "no tokenizer at this path: routing in approximate mode (text blocks, \
                                 docs/design.md §6); put the tokenizer there and restart for precise mode");
                            return None;
                        }
                        match ModelTokenizer::from_dir(dir) {
                            Ok(t) => Some(Arc::new(t)),
                            Err(e) => {
                                tracing::warn!(model = %m.name, dir = %dir.display(), error = %e,
                                    "tokenizer failed to load: routing in approximate mode");
                                None
                            }
                        }
                    })
                    .clone()
            });
            templates.entry(m.target().to_owned()).or_insert_with(|| (m.clone(), tokenizer.clone()));
            let resolved =
                build_model(&m.name, m.target(), m.adapter.as_deref(), m, tokenizer, block_size, &mut stores);
            out.insert(m.name.clone(), Arc::new(resolved));
        }
        Self {
            models: out,
            templates,
            block_size,
            stores: parking_lot::Mutex::new(stores),
            targets: parking_lot::RwLock::default(),
        }
    }

    /// The model for a rewrite target (docs/design.md §14): base model `base`, LoRA adapter
    /// `adapter`. Its tokenizer and mode are those of the first `models[]` entry of `base`
    /// (approximate mode with the default settings when there is none); its approximate store is
    /// the one of `base`. Built once and kept (up to [`MAX_TARGET_MODELS`]).
    pub fn target(&self, base: &str, adapter: Option<&str>) -> Arc<ResolvedModel> {
        let key = (base.to_owned(), adapter.map(str::to_owned));
        if let Some(m) = self.targets.read().get(&key) {
            return m.clone();
        }
        let default;
        let (cfg, tokenizer) = match self.templates.get(base) {
            Some((cfg, tok)) => (cfg, tok.clone()),
            None => {
                default = ModelConfig::named(base);
                (&default, None)
            }
        };
        let name = adapter.unwrap_or(base);
        let built = {
            let mut stores = self.stores.lock();
            Arc::new(build_model(name, base, adapter, cfg, tokenizer, self.block_size, &mut stores))
        };
        let mut targets = self.targets.write();
        if let Some(m) = targets.get(&key) {
            return m.clone();
        }
        if targets.len() < MAX_TARGET_MODELS {
            targets.insert(key, built.clone());
        }
        built
    }

    /// The model a request names, if configured.
    pub fn resolve(&self, name: &str) -> Option<&Arc<ResolvedModel>> {
        self.models.get(name)
    }

    /// Number of configured models.
    pub fn len(&self) -> usize {
        self.models.len()
    }

    /// True when no model is configured.
    pub fn is_empty(&self) -> bool {
        self.models.is_empty()
    }
}

/// One model ready to hash requests: `name` for clients, rooted at (`target`, `adapter`), with
/// `cfg`'s mode and approximate settings; the approximate store of `target` from `stores`.
fn build_model(
    name: &str,
    target: &str,
    adapter: Option<&str>,
    cfg: &ModelConfig,
    tokenizer: Option<Arc<ModelTokenizer>>,
    block_size: usize,
    stores: &mut HashMap<String, Arc<ApproxStore>>,
) -> ResolvedModel {
    let hasher = BlockHasher::new(target, adapter, block_size);
    let placeholder_name = cfg.image_placeholder.as_deref().unwrap_or(DEFAULT_IMAGE_PLACEHOLDER);
    let images = ImageSettings {
        placeholder: tokenizer.as_ref().and_then(|t| t.token_id(placeholder_name)),
        tokens_per_image: cfg.image_tokens,
        vision: cfg.vision.map(|v| v.smart_resize()),
        hash_model: cfg.image_hash_model.clone().unwrap_or_else(|| target.to_owned()),
    };
    if tokenizer.is_some()
        && images.placeholder.is_none()
        && (cfg.image_placeholder.is_some() || cfg.image_tokens.is_some() || cfg.vision.is_some())
    {
        tracing::warn!(model = %name, placeholder = placeholder_name,
            "the tokenizer has no image placeholder token: requests with images claim no blocks");
    }
    let approx = (cfg.effective_mode(tokenizer.is_some()) == RoutingMode::Approximate).then(|| {
        let a = &cfg.approximate;
        let store = stores.entry(target.to_owned()).or_insert_with(|| Arc::new(ApproxStore::new(a))).clone();
        tracing::info!(model = %name, block_chars = a.block_chars,
            capacity_blocks_per_pod = a.capacity_blocks_per_pod, "approximate prefix matching");
        ApproxModel { hasher: TextHasher::new(target, adapter, a.block_chars, a.max_blocks), store }
    });
    ResolvedModel {
        name: name.to_owned(),
        target_model: target.to_owned(),
        adapter: adapter.map(str::to_owned),
        tokenizer,
        hasher,
        approx,
        images,
        image_cache: Arc::default(),
    }
}

impl ResolvedModel {
    /// Approximate mode: clears `out` and writes the prompt's chain, text blocks for text and
    /// chat prompts, token blocks (capped like text) for token-id prompts, nothing otherwise.
    /// `codepoints` is scratch. Returns false (and writes nothing) in precise mode.
    pub fn approx_chain(&self, prompt: &PromptInput, codepoints: &mut Vec<u32>, out: &mut Vec<BlockHash>) -> bool {
        let Some(a) = &self.approx else { return false };
        out.clear();
        match prompt {
            PromptInput::Tokens(t) => {
                self.hasher.hash_prompt(t, out);
                out.truncate(self.approx_max_blocks());
            }
            other => {
                if let Some(text) = prompt_text(other) {
                    a.hasher.hash_text(&text, codepoints, out);
                }
            }
        }
        true
    }

    fn approx_max_blocks(&self) -> usize {
        self.approx.as_ref().map_or(usize::MAX, |a| a.hasher.max_blocks())
    }

    /// Token ids of the prompt; empty (with a warning) when it cannot be tokenized.
    pub fn tokens(&self, prompt: &PromptInput, request_id: &str) -> Vec<u32> {
        static NEVER: AtomicBool = AtomicBool::new(false);
        self.tokens_cancellable(prompt, request_id, &NEVER, usize::MAX).unwrap_or_default()
    }

    /// [`tokens`](Self::tokens) that stops once `cancel` is set (the request's ext_proc stream
    /// ended): `Err(Stopped::Cancelled)`, the work done so far dropped; a rendered chat prompt over
    /// `max_rendered_bytes` is `Err(Stopped::TooLarge)` before any tokenizing.
    pub fn tokens_cancellable(
        &self,
        prompt: &PromptInput,
        request_id: &str,
        cancel: &AtomicBool,
        max_rendered_bytes: usize,
    ) -> Result<Vec<u32>, Stopped> {
        let res = match (prompt, &self.tokenizer) {
            (PromptInput::Tokens(t), _) => return Ok(t.clone()),
            (PromptInput::None(why), _) => {
                tracing::debug!(request_id, reason = why, "no prompt tokens");
                return Ok(Vec::new());
            }
            (_, None) => {
                tracing::debug!(request_id, model = %self.name, "no tokenizer: routing by load");
                return Ok(Vec::new());
            }
            (PromptInput::Text(s), Some(t)) => t.encode_prompt_cancellable(s, cancel),
            (PromptInput::Chat(c), Some(t)) => t.encode_chat_bounded(c, cancel, max_rendered_bytes),
        };
        match res {
            Ok(ids) => Ok(ids),
            Err(kvroute_tokenize::TokenizeError::Cancelled) => Err(Stopped::Cancelled),
            Err(kvroute_tokenize::TokenizeError::RenderedTooLarge { limit, got }) => {
                Err(Stopped::TooLarge { limit, got })
            }
            Err(e) => {
                tracing::warn!(request_id, model = %self.name, error = %e, "tokenization failed: routing by load");
                Ok(Vec::new())
            }
        }
    }

    /// Places a chat request's `images` (from [`chat_images`]) in its rendered `tokens` as the
    /// engine does (docs/design.md §2): each image's placeholder token, when the picker knows the
    /// image's token count ([`ResolvedModel::reproduce_image`]), is expanded in `tokens` to that
    /// many tokens (else it stays one token), and becomes an [`MmItem`] when its identifier is
    /// known too and every image before it was one; the first image that is not ends the
    /// claimable prefix at its position. Images sized from their header whose identifier is
    /// read later are listed in `deferred`. `Err` (nothing claimable) when the tokenizer has no placeholder token or the
    /// rendered prompt does not hold one per image (the template does not render them, or a text
    /// holds the token). Without images: nothing to place, everything claimable.
    pub fn place_images(
        &self,
        images: &[ChatImage<'_>],
        tokens: &mut Vec<u32>,
    ) -> Result<ImagePlacement, &'static str> {
        if images.is_empty() {
            return Ok(ImagePlacement { items: Vec::new(), claimable: tokens.len(), deferred: Vec::new() });
        }
        let Some(pad) = self.images.placeholder else {
            return Err("images, and the tokenizer has no image placeholder token");
        };
        if tokens.iter().filter(|t| **t == pad).count() != images.len() {
            return Err("the rendered prompt does not hold one image placeholder per image");
        }
        let mut out = Vec::with_capacity(tokens.len());
        let mut items = Vec::new();
        let mut deferred = Vec::new();
        let mut claimable = None;
        let mut next = images.iter().enumerate();
        for &t in tokens.iter() {
            if t != pad {
                out.push(t);
                continue;
            }
            let Some((index, image)) = next.next() else {
                out.push(t);
                continue;
            };
            let placed =
                self.reproduce_image(image).filter(|r| out.len() + r.tokens + tokens.len() <= MAX_EXPANDED_TOKENS);
            let Some(r) = placed else {
                claimable.get_or_insert(out.len());
                out.push(t);
                continue;
            };
            if let Some(key) = r.deferred {
                deferred.push((index, key));
            }
            match r.identifier {
                Some(identifier) if claimable.is_none() => {
                    items.push(MmItem { identifier, offset: out.len(), length: r.tokens });
                }
                _ => {
                    claimable.get_or_insert(out.len());
                }
            }
            out.extend(std::iter::repeat_n(pad, r.tokens));
        }
        *tokens = out;
        Ok(ImagePlacement { items, claimable: claimable.unwrap_or(tokens.len()), deferred })
    }

    /// Reads an inline image's identifier in the background for a later request: `url` (a
    /// `data:` URL that [`ResolvedModel::place_images`] listed in `deferred`, moved out of the
    /// request so nothing is copied), with `key` its payload's [`payload_key`] listed there, is queued for the process's reader thread, which reads it
    /// whole ([`inline_image`]) into this model's [`ImageCache`]. False (the read dropped) when
    /// `url` is not a data URL, the queue holds [`IMAGE_READ_QUEUE`] reads or
    /// [`IMAGE_READ_QUEUE_BYTES`] bytes, or the reader is not running. Never blocks.
    pub fn read_later(&self, url: String, key: [u8; 32]) -> bool {
        let Some(payload_at) = data_url_payload(&url).map(|p| url.len() - p.len()) else { return false };
        let Some(reader) = image_reader() else { return false };
        let len = url.len();
        if reader.queued_bytes.fetch_add(len, Ordering::Relaxed).saturating_add(len) > IMAGE_READ_QUEUE_BYTES {
            reader.queued_bytes.fetch_sub(len, Ordering::Relaxed);
            return false;
        }
        let (cache, hash_model) = (self.image_cache.clone(), self.images.hash_model.clone());
        let job = ImageJob { url, payload_at, key, cache, hash_model };
        match reader.queue.try_send(job) {
            Ok(()) => true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                reader.queued_bytes.fetch_sub(len, Ordering::Relaxed);
                false
            }
        }
    }

    /// Placeholder tokens and identifier of `image` as the engine derives them (docs/design.md
    /// §2), or `None` when the picker cannot know the count:
    /// - the count is `image_tokens` when fixed; with `vision`, the Qwen2-VL count of the size
    ///   in the header of an inline PNG, JPEG, WebP, GIF or BMP (`data:<type>;base64,`);
    ///   otherwise unknown;
    /// - the identifier is the `uuid`, else vLLM's content hash of the inline image's bytes when
    ///   the payload is small or the model's [`ImageCache`] holds it; else none, `deferred`.
    ///
    /// An http(s) URL without `uuid` is never fetched; malformed base64, a truncated or foreign
    /// header, a zero side, an aspect ratio over 200 or more than 178,956,970 pixels (vLLM
    /// refuses those), more than [`MAX_INLINE_IMAGE_BYTES`] or [`crate::config::MAX_IMAGE_TOKENS`]
    /// tokens: `None`. Work ([`ImageCache::lookup`]): the header's piece of the payload, and
    /// without `uuid` one BLAKE3 pass over the payload's text (a small payload is read whole);
    /// pixels are never decoded.
    pub fn reproduce_image(&self, image: &ChatImage<'_>) -> Option<ReproducedImage> {
        let settings = &self.images;
        if settings.tokens_per_image.is_none() && settings.vision.is_none() {
            return None;
        }
        let needs_bytes = settings.tokens_per_image.is_none() || image.uuid.is_none();
        // An inline image is always sized: the count may need it, and an image vLLM could not
        // open is refused there, so the picker claims nothing on it.
        let (inline, deferred) = if needs_bytes {
            let payload = data_url_payload(image.url?)?;
            let hash_model = image.uuid.is_none().then_some(settings.hash_model.as_str());
            let (inline, later) = self.image_cache.lookup(payload, hash_model)?;
            (Some(inline), later)
        } else {
            (None, None)
        };
        let tokens = match (settings.tokens_per_image, settings.vision, &inline) {
            (Some(n), _, _) => n,
            (None, Some(vision), Some(InlineImage { size: (width, height), .. })) => {
                vision.tokens(*width, *height).filter(|n| (1..=crate::config::MAX_IMAGE_TOKENS).contains(n))?
            }
            _ => return None,
        };
        let identifier = match (image.uuid, inline) {
            (Some(uuid), _) => Some(uuid.to_owned()),
            (None, Some(InlineImage { identifier, .. })) => identifier,
            (None, None) => None,
        };
        Some(ReproducedImage { tokens, identifier, deferred })
    }
}

/// Why [`ResolvedModel::tokens_cancellable`] stopped without token ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// The request was abandoned (or ran past its tokenization deadline): `cancel` was set.
    Cancelled,
    /// The rendered chat prompt is longer than `max_rendered_bytes` (nothing was tokenized).
    TooLarge {
        /// The bound, bytes.
        limit: usize,
        /// The rendered prompt's length, bytes.
        got: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A PNG of `width` × 1 pixels whose IDAT holds `n` bytes of `seed` (the picker reads the
    /// header and hashes the rest), as the base64 payload of a data URL.
    fn png_payload(width: u32, n: usize, seed: u8) -> String {
        use base64::Engine as _;
        let mut b = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
        b.extend_from_slice(&width.to_be_bytes());
        b.extend_from_slice(&1u32.to_be_bytes());
        b.extend_from_slice(&[8, 2, 0, 0, 0, 0, 0, 0, 0]);
        b.extend((0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed));
        base64::engine::general_purpose::STANDARD.encode(&b)
    }

    /// docs/decisions/0048-inline-image-cache.md: a payload read again answers from the cache
    /// exactly as reading it does (an identifier asked for after a size-only read is computed,
    /// not left out), malformed or small payloads are not kept, and the cache stays within two
    /// generations however many images pass.
    #[test]
    fn image_cache_answers_as_reading_and_stays_bounded() {
        let cache = ImageCache::default();
        let (a, b) = (png_payload(640, 40_000, 1), png_payload(800, 40_000, 2));
        let direct = |p: &str, m: Option<&str>| inline_image(p, m, MAX_INLINE_IMAGE_BYTES);
        assert_eq!(cache.read(&a, None), direct(&a, None));
        assert_eq!(cache.len(), 1);
        let with_id = cache.read(&a, Some("vl")).unwrap();
        assert_eq!(Some(&with_id), direct(&a, Some("vl")).as_ref());
        assert!(with_id.identifier.is_some(), "asked for, so computed");
        assert_eq!(cache.read(&a, Some("vl")).as_ref(), Some(&with_id), "a hit");
        assert_eq!(cache.read(&a, None).map(|i| i.size), Some((640, 1)));
        assert_eq!(cache.len(), 1);
        let other = cache.read(&b, Some("vl")).unwrap();
        assert_eq!((other.size, other.identifier.is_some()), ((800, 1), true));
        assert_ne!(other.identifier, with_id.identifier);
        // Refused payloads and small ones are not kept.
        let bad = format!("{}!", &a[..a.len() - 4]);
        assert_eq!(cache.read(&bad, Some("vl")), None);
        let small = png_payload(10, 100, 3);
        assert_eq!(cache.read(&small, Some("vl")), direct(&small, Some("vl")));
        assert_eq!(cache.len(), 2);
        // Bounded: the newest generation keeps the latest images, the oldest are dropped.
        let many: Vec<String> =
            (0..2 * IMAGE_CACHE_ENTRIES + 5).map(|i| png_payload(100 + i as u32, 13_000, 4)).collect();
        for p in &many {
            assert!(cache.read(p, None).is_some());
        }
        assert!(cache.len() <= 2 * IMAGE_CACHE_ENTRIES, "{}", cache.len());
        let last = many.last().unwrap();
        assert_eq!(cache.read(last, None), direct(last, None));
        assert_eq!(cache.read(&a, Some("vl")).as_ref(), Some(&with_id), "read again after eviction");
    }

    #[test]
    fn registry_resolves_and_hashes_under_adapter_root() {
        let cfg = vec![
            ModelConfig { target_model: Some("base".into()), ..ModelConfig::named("a") },
            ModelConfig { target_model: Some("base".into()), adapter: Some("l".into()), ..ModelConfig::named("b") },
        ];
        let r = ModelRegistry::load(&cfg, 16);
        let a = r.resolve("a").unwrap();
        let b = r.resolve("b").unwrap();
        assert_eq!(a.target_model, "base");
        assert_eq!(b.adapter.as_deref(), Some("l"));
        assert_ne!(a.hasher.root(), b.hasher.root());
        assert!(r.resolve("c").is_none());
        // No tokenizer: text prompts give no tokens, token prompts pass through.
        assert!(a.tokens(&PromptInput::Text("x".into()), "r").is_empty());
        assert_eq!(a.tokens(&PromptInput::Tokens(vec![7; 3]), "r"), vec![7; 3]);
    }

    #[test]
    fn an_absent_tokenizer_source_means_approximate_mode_and_a_present_one_precise() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("not-mounted");
        let cfg =
            |tok: &std::path::Path| vec![ModelConfig { tokenizer: Some(tok.to_path_buf()), ..ModelConfig::named("m") }];
        let r = ModelRegistry::load(&cfg(&missing), 16);
        let m = r.resolve("m").unwrap();
        assert!(m.tokenizer.is_none() && m.approx.is_some(), "no tokenizer there: approximate mode");
        let fixture = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer-qwen2.5");
        let r = ModelRegistry::load(&cfg(&fixture), 16);
        let m = r.resolve("m").unwrap();
        assert!(m.tokenizer.is_some() && m.approx.is_none(), "the tokenizer added: precise mode");
    }

    #[test]
    fn approximate_by_default_without_tokenizer_store_shared_per_base_model() {
        let cfg = vec![
            ModelConfig { target_model: Some("base".into()), ..ModelConfig::named("a") },
            ModelConfig { target_model: Some("base".into()), adapter: Some("l".into()), ..ModelConfig::named("b") },
            ModelConfig::named("other"),
        ];
        let r = ModelRegistry::load(&cfg, 16);
        let (a, b, o) = (r.resolve("a").unwrap(), r.resolve("b").unwrap(), r.resolve("other").unwrap());
        let (aa, ba, oa) = (a.approx.as_ref().unwrap(), b.approx.as_ref().unwrap(), o.approx.as_ref().unwrap());
        assert!(Arc::ptr_eq(&aa.store, &ba.store));
        assert!(!Arc::ptr_eq(&aa.store, &oa.store));
        let (mut cp, mut ca, mut cb) = (Vec::new(), Vec::new(), Vec::new());
        let text = PromptInput::Text("x".repeat(200));
        assert!(a.approx_chain(&text, &mut cp, &mut ca));
        assert!(b.approx_chain(&text, &mut cp, &mut cb));
        assert_eq!(ca.len(), 3, "200 characters: three full 64-character blocks");
        assert_ne!(ca, cb, "adapters root their own chains");
        assert!(a.approx_chain(&PromptInput::Tokens(vec![1; 40]), &mut cp, &mut ca));
        assert_eq!(ca.len(), 2, "token prompts: 16-token blocks");
        assert!(a.approx_chain(&PromptInput::None("salt"), &mut cp, &mut ca));
        assert!(ca.is_empty());
    }
}
