//! Prompt → token ids, computed the way vLLM computes them (SPEC §6).
//!
//! STUB: the API below is the contract the picker and the engine emulator build against;
//! the implementation is being written.

use std::path::Path;

/// Errors from loading a tokenizer or turning a request into token ids.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizeError {
    #[error("not implemented yet")]
    NotImplemented,
}

/// The chat part of an OpenAI `/v1/chat/completions` body that the template sees.
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct ChatRequest {
    /// `messages`: role/content objects (content a string or an array of parts).
    pub messages: Vec<serde_json::Value>,
    /// `tools`: OpenAI tool definitions, if any.
    #[serde(default)]
    pub tools: Option<Vec<serde_json::Value>>,
}

/// A model's tokenizer and chat template, loaded from a HuggingFace model directory.
#[derive(Debug)]
pub struct ModelTokenizer {}

impl ModelTokenizer {
    /// Loads `dir/tokenizer.json` and `dir/tokenizer_config.json`.
    pub fn from_dir(_dir: &Path) -> Result<Self, TokenizeError> {
        Err(TokenizeError::NotImplemented)
    }
    /// Ids of a `/v1/completions` prompt string, as vLLM's completions endpoint tokenizes it.
    pub fn encode_prompt(&self, _prompt: &str) -> Result<Vec<u32>, TokenizeError> {
        Err(TokenizeError::NotImplemented)
    }
    /// The chat template rendered with `add_generation_prompt: true`.
    pub fn render_chat(&self, _chat: &ChatRequest) -> Result<String, TokenizeError> {
        Err(TokenizeError::NotImplemented)
    }
    /// Ids of a chat request, as vLLM's chat endpoint computes them.
    pub fn encode_chat(&self, _chat: &ChatRequest) -> Result<Vec<u32>, TokenizeError> {
        Err(TokenizeError::NotImplemented)
    }
    /// Text of token ids (special tokens kept), for the emulator's generated output.
    pub fn decode(&self, _ids: &[u32]) -> Result<String, TokenizeError> {
        Err(TokenizeError::NotImplemented)
    }
}
