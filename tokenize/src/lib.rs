//! Prompt → token ids, computed the way vLLM computes them (docs/design.md §6).
//!
//! - `/v1/completions`: HF `tokenizer(prompt)` (`add_special_tokens=True`; the `tokenizer.json`
//!   post-processor decides what is added: nothing for Qwen, BOS for Llama 3).
//! - `/v1/chat/completions`: the model's chat template rendered like transformers'
//!   `apply_chat_template(..., add_generation_prompt=True)` (see [`template`]), then encoded with
//!   `add_special_tokens=False`; special tokens in the rendered text are matched as added tokens.
//!
//! Speed: encoding goes through a [`SegmentCache`] of the pieces between added tokens (see
//! [`segment`]), so the turns of a conversation after the first re-use the earlier turns' ids.
//! The cache is exact by construction and checked at load time; a tokenizer for which it cannot be
//! exact is encoded whole every time (logged at `warn`).
//!
//! Concurrency: a [`ModelTokenizer`] is immutable after [`ModelTokenizer::from_dir`] except for the
//! internally locked cache; it is `Send + Sync` and meant to be shared (`Arc`) by all tasks that
//! serve one model. Every method may be called concurrently and blocks only for a cache-shard lock.

use std::sync::atomic::{AtomicBool, Ordering};

/// A cancellation flag that is never set (the non-cancellable entry points).
static NEVER: AtomicBool = AtomicBool::new(false);

mod config;
mod error;
mod pyjson;
pub mod segment;
mod strftime;
pub mod template;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokenizers::Tokenizer;

pub use config::TokenizerConfig;
pub use error::TokenizeError;
use segment::{Piece, Segmenter};
pub use segment::{SegmentCache, SegmentCacheConfig, SegmentCacheStats};
use template::ChatTemplate;

/// The chat part of an OpenAI `/v1/chat/completions` body that the template sees.
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct ChatRequest {
    /// `messages`: role/content objects (content a string or an array of parts).
    pub messages: Vec<serde_json::Value>,
    /// `tools`: OpenAI tool definitions, if any.
    #[serde(default)]
    pub tools: Option<Vec<serde_json::Value>>,
}

/// How a [`ModelTokenizer`] is built beyond the model directory.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokenizerOptions {
    /// Segment cache sizing; `max_bytes: 0` turns the cache off (every text encoded whole).
    pub segment_cache: SegmentCacheConfig,
}

/// A model's tokenizer and chat template, loaded from a HuggingFace model directory.
pub struct ModelTokenizer {
    dir: PathBuf,
    tokenizer: Tokenizer,
    /// The same `tokenizer.json` in splintr, used for `add_special_tokens=False` encodes when it
    /// matched `tokenizers` on the check texts at load time ([`FAST_CHECK_TEXTS`]).
    fast: Option<splintr::AnyTokenizer>,
    config: TokenizerConfig,
    template: Option<ChatTemplate>,
    /// Present when encoding piece by piece is exact for this tokenizer and the cache is on.
    segments: Option<(Segmenter, SegmentCache)>,
    /// Ids the post-processor puts before/after a completions prompt (`add_special_tokens=True`),
    /// when it is a fixed wrapper; `None` means "encode whole with the post-processor".
    prompt_wrap: Option<(Vec<u32>, Vec<u32>)>,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("dir", &self.dir)
            .field("vocab_size", &self.tokenizer.get_vocab_size(true))
            .field("chat_template", &self.template.is_some())
            .field("segment_cache", &self.segments.as_ref().map(|(_, c)| c.stats()))
            .field("prompt_wrap", &self.prompt_wrap)
            .finish()
    }
}

const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ModelTokenizer>();
};

impl ModelTokenizer {
    /// Loads `dir/tokenizer.json` and `dir/tokenizer_config.json` with default options.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizeError> {
        Self::from_dir_with(dir, TokenizerOptions::default())
    }

    /// Loads `dir/tokenizer.json`, `dir/tokenizer_config.json` (optional) and
    /// `dir/chat_template.jinja` (optional). A chat template that does not compile is an error here,
    /// not at the first request.
    pub fn from_dir_with(dir: &Path, options: TokenizerOptions) -> Result<Self, TokenizeError> {
        if !dir.is_dir() {
            return Err(TokenizeError::Io {
                path: dir.to_owned(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "not a directory"),
            });
        }
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).map_err(|source| TokenizeError::Io { path: path.clone(), source })?;
        let mut tokenizer = Tokenizer::from_bytes(&bytes)
            .map_err(|e| TokenizeError::TokenizerFile { path: path.clone(), message: e.to_string() })?;
        // transformers turns these off unless a call asks for them; vLLM never does for prompts.
        tokenizer
            .with_truncation(None)
            .map_err(|e| TokenizeError::TokenizerFile { path: path.clone(), message: e.to_string() })?;
        tokenizer.with_padding(None);

        let config = TokenizerConfig::load(dir)?;
        let template = match &config.chat_template {
            Some((source, from)) => {
                let specials = [
                    ("bos_token", &config.bos_token),
                    ("eos_token", &config.eos_token),
                    ("pad_token", &config.pad_token),
                    ("unk_token", &config.unk_token),
                ]
                .into_iter()
                .filter_map(|(name, tok)| tok.clone().map(|t| (name, t)))
                .collect();
                Some(ChatTemplate::new(source, from, specials)?)
            }
            None => None,
        };

        let fast = splintr::from_json_bytes(&bytes)
            .map_err(|e| tracing::info!(dir = %dir.display(), error = %e, "splintr cannot load this tokenizer; using tokenizers"))
            .ok();
        let mut this =
            Self { dir: dir.to_owned(), tokenizer, fast, config, template, segments: None, prompt_wrap: None };
        this.check_fast();
        this.segments = this.build_segments(options.segment_cache);
        this.prompt_wrap = this.learn_prompt_wrap();
        this.check_add_bos_token();
        tracing::info!(
            dir = %dir.display(),
            vocab = this.tokenizer.get_vocab_size(true),
            chat_template = this.template.is_some(),
            segment_cache = this.segments.is_some(),
            fast_bpe = this.fast.is_some(),
            "tokenizer loaded"
        );
        Ok(this)
    }

    /// Ids of a `/v1/completions` prompt string, as vLLM's completions endpoint tokenizes it.
    pub fn encode_prompt(&self, prompt: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode_prompt_cancellable(prompt, &NEVER)
    }

    /// [`encode_prompt`](Self::encode_prompt) that stops with [`TokenizeError::Cancelled`] once
    /// `cancel` is set, checked between the segment cache's pieces (at most a chunk of
    /// `segment::CHUNK_BYTES` is encoded after it is set; without the segment cache the text is
    /// encoded whole and only checked before).
    pub fn encode_prompt_cancellable(&self, prompt: &str, cancel: &AtomicBool) -> Result<Vec<u32>, TokenizeError> {
        match &self.prompt_wrap {
            Some((prefix, suffix)) => {
                let mut ids = prefix.clone();
                self.encode_text_into(prompt, &mut ids, cancel)?;
                ids.extend_from_slice(suffix);
                Ok(ids)
            }
            None if cancel.load(Ordering::Relaxed) => Err(TokenizeError::Cancelled),
            None => self.encode_whole(prompt, true),
        }
    }

    /// The chat template rendered with `add_generation_prompt: true`.
    pub fn render_chat(&self, chat: &ChatRequest) -> Result<String, TokenizeError> {
        let template = self.template.as_ref().ok_or_else(|| TokenizeError::NoChatTemplate { dir: self.dir.clone() })?;
        template.render(chat)
    }

    /// Ids of a chat request, as vLLM's chat endpoint computes them.
    pub fn encode_chat(&self, chat: &ChatRequest) -> Result<Vec<u32>, TokenizeError> {
        self.encode_chat_cancellable(chat, &NEVER)
    }

    /// [`encode_chat`](Self::encode_chat) that stops once `cancel` is set (as
    /// [`encode_prompt_cancellable`](Self::encode_prompt_cancellable)).
    pub fn encode_chat_cancellable(&self, chat: &ChatRequest, cancel: &AtomicBool) -> Result<Vec<u32>, TokenizeError> {
        self.encode_chat_bounded(chat, cancel, usize::MAX)
    }

    /// [`encode_chat_cancellable`](Self::encode_chat_cancellable) that refuses a rendered prompt
    /// longer than `max_rendered_bytes` before tokenizing it ([`TokenizeError::RenderedTooLarge`]).
    pub fn encode_chat_bounded(
        &self,
        chat: &ChatRequest,
        cancel: &AtomicBool,
        max_rendered_bytes: usize,
    ) -> Result<Vec<u32>, TokenizeError> {
        let text = self.render_chat(chat)?;
        if text.len() > max_rendered_bytes {
            return Err(TokenizeError::RenderedTooLarge { limit: max_rendered_bytes, got: text.len() });
        }
        let mut ids = Vec::with_capacity(text.len() / 3 + 8);
        self.encode_text_into(&text, &mut ids, cancel)?;
        Ok(ids)
    }

    /// Ids of `text` with `add_special_tokens=False` (special tokens in it are matched): what vLLM
    /// feeds the engine for a rendered chat. Uses the segment cache when it is on.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 8);
        self.encode_text_into(text, &mut ids, &NEVER)?;
        Ok(ids)
    }

    /// [`encode_text`](Self::encode_text) without the segment cache and without splintr: one
    /// `tokenizers` call (the reference).
    pub fn encode_text_uncached(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode_reference(text, false)
    }

    /// True when `add_special_tokens=False` encodes go through splintr (it matched at load).
    pub fn fast_bpe(&self) -> bool {
        self.fast.is_some()
    }

    /// Keeps splintr only if it gives `tokenizers`' ids on every check text.
    fn check_fast(&mut self) {
        let Some(fast) = &self.fast else { return };
        let mut added: Vec<_> = self.tokenizer.get_added_tokens_decoder().into_values().map(|t| t.content).collect();
        added.sort();
        let mut texts: Vec<String> = FAST_CHECK_TEXTS.iter().map(|t| (*t).to_owned()).collect();
        texts.push(added.concat());
        texts.push(added.iter().map(|t| format!("x {t}\n y")).collect());
        let mismatch =
            texts.iter().find(|t| self.encode_reference(t, false).ok().as_ref() != Some(&fast.encode_raw(t)));
        if let Some(t) = mismatch {
            tracing::warn!(dir = %self.dir.display(), text = %t, "splintr differs from tokenizers; using tokenizers");
            self.fast = None;
        }
    }

    /// Text of token ids (special tokens kept), for the emulator's generated output.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        self.tokenizer.decode(ids, false).map_err(|e| TokenizeError::Decode(e.to_string()))
    }

    /// The id of a token string (vocabulary or added token), e.g. `"<|im_end|>"`.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// The id of `eos_token` from `tokenizer_config.json`, if it names a known token.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.config.eos_token.as_deref().and_then(|t| self.token_id(t))
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The parsed `tokenizer_config.json`.
    pub fn config(&self) -> &TokenizerConfig {
        &self.config
    }

    /// Segment-cache counters; `None` when the cache is off or not exact for this tokenizer.
    pub fn cache_stats(&self) -> Option<SegmentCacheStats> {
        self.segments.as_ref().map(|(_, cache)| cache.stats())
    }

    fn encode_whole(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        if !add_special_tokens && let Some(fast) = &self.fast {
            return Ok(fast.encode_raw(text));
        }
        self.encode_reference(text, add_special_tokens)
    }

    /// `tokenizers` itself: the reference every other path must equal.
    fn encode_reference(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        let encoding =
            self.tokenizer.encode_fast(text, add_special_tokens).map_err(|e| TokenizeError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    fn encode_text_into(&self, text: &str, ids: &mut Vec<u32>, cancel: &AtomicBool) -> Result<(), TokenizeError> {
        if cancel.load(Ordering::Relaxed) {
            return Err(TokenizeError::Cancelled);
        }
        let Some((segmenter, cache)) = &self.segments else {
            ids.extend(self.encode_whole(text, false)?);
            return Ok(());
        };
        segmenter.for_each_piece(text, |piece| {
            if cancel.load(Ordering::Relaxed) {
                return Err(TokenizeError::Cancelled);
            }
            match piece {
                Piece::Added(id) => ids.push(id),
                Piece::Text(t) => ids.extend_from_slice(&cache.get_or_encode(t, |t| self.encode_whole(t, false))?),
            }
            Ok(())
        })
    }

    /// Segmentation is enabled only if it is exact by construction and on a probe text.
    fn build_segments(&self, config: SegmentCacheConfig) -> Option<(Segmenter, SegmentCache)> {
        if config.max_bytes == 0 {
            return None;
        }
        let segmenter = match Segmenter::new(&self.tokenizer) {
            Ok(s) => s,
            Err(why) => {
                tracing::warn!(dir = %self.dir.display(), %why, "segment cache off: splitting at added tokens would not be exact");
                return None;
            }
        };
        let mut added: Vec<_> = self.tokenizer.get_added_tokens_decoder().into_values().map(|t| t.content).collect();
        added.sort();
        let a = added.first().map_or("", String::as_str);
        let b = added.last().map_or("", String::as_str);
        // Long enough to be cut into chunks where the segmenter cuts (segment::CHUNK_BYTES).
        let long: String =
            (0..60).map(|i| ["It's 12 cats, ok? ", "word ", "Grüße  x ", "a1 b\n", "don't  stop "][i % 5]).collect();
        let probe = format!("{a}system\nHello, world!  \n\n{b} x  y\t{a}{b}Grüße 你好 123{a}\n end {long}{long}{a}");
        let whole = self.encode_whole(&probe, false).ok()?;
        let mut pieces = Vec::new();
        let split_ok = segmenter
            .for_each_piece(&probe, |p| {
                match p {
                    Piece::Added(id) => pieces.push(id),
                    Piece::Text(t) => pieces.extend(self.encode_whole(t, false)?),
                }
                Ok::<_, TokenizeError>(())
            })
            .is_ok();
        if !split_ok || pieces != whole {
            tracing::warn!(dir = %self.dir.display(), "segment cache off: piecewise encoding differs from whole encoding on the probe text");
            return None;
        }
        Some((segmenter, SegmentCache::new(config)))
    }

    /// Learns `encode(p, true) == prefix + encode(p, false) + suffix` from two probes.
    fn learn_prompt_wrap(&self) -> Option<(Vec<u32>, Vec<u32>)> {
        let split = |probe: &str| -> Option<(Vec<u32>, Vec<u32>)> {
            let with = self.encode_whole(probe, true).ok()?;
            let without = self.encode_whole(probe, false).ok()?;
            let extra = with.len().checked_sub(without.len())?;
            let k = (0..=extra).find(|&k| with[k..k + without.len()] == without[..])?;
            Some((with[..k].to_vec(), with[k + without.len()..].to_vec()))
        };
        let first = split("Hello world, this is a probe.")?;
        let second = split(" 12 x\n\ny ")?;
        (first == second).then_some(first)
    }

    /// transformers' fast tokenizers follow `tokenizer.json`'s post-processor; a config that says
    /// otherwise is worth a warning because the engine side may differ by tokenizer class.
    fn check_add_bos_token(&self) {
        let (Some(want), Some(bos)) = (self.config.add_bos_token, self.config.bos_token.as_deref()) else { return };
        let bos_id = self.token_id(bos);
        let adds = match (&self.prompt_wrap, bos_id) {
            (Some((prefix, _)), Some(id)) => prefix.first() == Some(&id),
            _ => return,
        };
        if adds != want {
            tracing::warn!(
                dir = %self.dir.display(),
                add_bos_token = want,
                post_processor_adds_bos = adds,
                "tokenizer_config.json add_bos_token disagrees with tokenizer.json's post-processor; following the post-processor"
            );
        }
    }
}

/// Texts on which splintr must give `tokenizers`' ids before it is used: contractions, whitespace
/// runs around newlines and tabs, digits, punctuation, non-Latin scripts, combining marks, emoji.
const FAST_CHECK_TEXTS: &[&str] = &[
    "Hello, world! It's 12:30 — don't panic.\n\n  indented\tTAB's  \n \r\n end ",
    "I'M HERE, you'RE there; we'VE, they'LL, he'D. \t's\n's  'll \n\n    \n x",
    "fn main() {\n    let x = 1_000_000;\n    return x;\n}\n\n\n",
    "Grüße, café, naïve, e\u{301}, ñ, ß, ſ; 你好世界，日本語のテキスト。한국어 텍스트. Привет мир! العربية עברית ελληνικά",
    "emoji 🙂🚀👍🏽 and\u{200b}zero\u{a0}width\u{3000}spaces ｱｲｳ १२३ 123456789 3.14159 1e-9 0x1F",
    "http://example.com/a?b=c&d=e#f <tag attr=\"v\"> {\"json\": [1, 2, {\"k\": null}]} $$x^2$$ \\n",
    "   leading and trailing spaces   \n\n\n\t\t\n",
];

/// Shared handle, as the picker keeps one per model.
pub type SharedTokenizer = Arc<ModelTokenizer>;
