//! The one error type of this crate: loading a model directory, rendering a chat, encoding, decoding.
//!
//! Every variant says what was wrong and where (file path, template line) so that a picker
//! operator can fix a model directory without reading the code.

use std::path::PathBuf;

/// Errors from loading a tokenizer or turning a request into token ids.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizeError {
    /// The caller's cancellation flag was set while encoding (the request's client went away);
    /// the work stopped at the next chunk.
    #[error("tokenization cancelled: the request was abandoned")]
    Cancelled,
    /// The chat template's output is longer than the caller's bound (nothing was tokenized).
    #[error("rendered chat prompt of {got} bytes is over the bound of {limit}")]
    RenderedTooLarge {
        /// The bound, bytes.
        limit: usize,
        /// The rendered prompt's length, bytes.
        got: usize,
    },
    /// A file of the model directory could not be read (missing directory, missing file, permissions).
    #[error("cannot read {path}: {source} (expected a HuggingFace model directory with tokenizer.json)")]
    Io {
        /// The file that could not be read.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// `tokenizer.json` exists but the `tokenizers` crate rejects it.
    #[error("{path} is not a valid HuggingFace tokenizer.json: {message}")]
    TokenizerFile {
        /// The offending file.
        path: PathBuf,
        /// What the `tokenizers` crate reported.
        message: String,
    },
    /// `tokenizer_config.json` (or `chat_template.jinja`) exists but a field has the wrong shape.
    #[error("{path}: {message}")]
    Config {
        /// The offending file.
        path: PathBuf,
        /// Which field is wrong and how.
        message: String,
    },
    /// The chat template does not compile as Jinja.
    #[error("chat template from {path} does not compile: {message}")]
    TemplateSyntax {
        /// The file the template came from.
        path: PathBuf,
        /// minijinja's error, with line information.
        message: String,
    },
    /// A chat request was made but the model directory has no chat template.
    #[error(
        "model directory {dir} has no chat template (no `chat_template` in tokenizer_config.json, no chat_template.jinja)"
    )]
    NoChatTemplate {
        /// The model directory.
        dir: PathBuf,
    },
    /// The chat template failed while rendering a request (including `raise_exception(...)` calls).
    #[error("chat template failed to render the request: {0}")]
    Render(String),
    /// The request is not something the template can be given (e.g. a message that is not an object).
    #[error("invalid chat request: {0}")]
    InvalidRequest(String),
    /// The tokenizer failed to encode text.
    #[error("tokenizer failed to encode: {0}")]
    Encode(String),
    /// The tokenizer failed to decode ids (e.g. an id outside the vocabulary).
    #[error("tokenizer failed to decode: {0}")]
    Decode(String),
}
