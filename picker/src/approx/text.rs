//! Text of a request and its chained block hashes (approximate mode).
//!
//! Chain: `p_0 = hash_block(root_hash(model, adapter), [TEXT_DOMAIN])`, then
//! `p_i = hash_block(p_{i-1}, code points of block i)` for each full block of `block_chars`
//! characters: the precise path's XXH3 chain (docs/design.md §2) over Unicode scalar values instead of token
//! ids. The domain tag keeps text chains apart from token chains of the same root. Only full
//! blocks are hashed, as vLLM only caches full blocks.

use kvroute_common::BlockHash;
use kvroute_common::hash::{hash_block, root_hash};
use serde_json::Value;

use crate::request::PromptInput;

/// Domain tag hashed under the root so a text chain never equals a token chain ("TEXT").
const TEXT_DOMAIN: u32 = 0x5445_5854;

/// Separates a message's role from its content, and messages from each other (ASCII unit and
/// record separators, which do not occur in ordinary text).
const ROLE_SEP: char = '\u{1f}';
const MESSAGE_SEP: char = '\u{1e}';

/// Hashes text into a block chain rooted at (model, adapter).
#[derive(Debug, Clone)]
pub struct TextHasher {
    root: BlockHash,
    block_chars: usize,
    max_blocks: usize,
}

impl TextHasher {
    /// A hasher for `block_chars`-character blocks (≥ 1; 0 is treated as 1), at most `max_blocks`
    /// blocks per text.
    pub fn new(model: &str, adapter: Option<&str>, block_chars: usize, max_blocks: usize) -> Self {
        let root = hash_block(root_hash(model, adapter), &[TEXT_DOMAIN]);
        Self { root, block_chars: block_chars.max(1), max_blocks }
    }

    /// The chain's root `p_0`.
    pub fn root(&self) -> BlockHash {
        self.root
    }

    /// Characters per block.
    pub fn block_chars(&self) -> usize {
        self.block_chars
    }

    /// Blocks hashed per text at most.
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    /// Clears `out` and appends the hash of each full block of `text` (at most `max_blocks`).
    /// `codepoints` is a scratch buffer reused across calls.
    pub fn hash_text(&self, text: &str, codepoints: &mut Vec<u32>, out: &mut Vec<BlockHash>) {
        out.clear();
        codepoints.clear();
        let limit = self.block_chars.saturating_mul(self.max_blocks);
        codepoints.extend(text.chars().take(limit).map(u32::from));
        let mut prev = self.root;
        for block in codepoints.chunks_exact(self.block_chars) {
            prev = hash_block(prev, block);
            out.push(prev);
        }
    }
}

/// The text approximate mode hashes for a prompt: the completion prompt as is; for chat, the
/// tools (JSON, when present) then each message as `role ␟ content ␞`. `None` for token prompts
/// and unmatchable requests.
pub fn prompt_text(prompt: &PromptInput) -> Option<String> {
    match prompt {
        PromptInput::Text(s) => Some(s.clone()),
        PromptInput::Chat(chat) => {
            let mut out = String::new();
            if let Some(tools) = &chat.tools {
                out.push_str(&Value::Array(tools.clone()).to_string());
                out.push(MESSAGE_SEP);
            }
            for m in &chat.messages {
                let role = m.get("role").and_then(Value::as_str).unwrap_or("");
                out.push_str(role);
                out.push(ROLE_SEP);
                push_content(&mut out, m.get("content"));
                out.push(MESSAGE_SEP);
            }
            Some(out)
        }
        PromptInput::Tokens(_) | PromptInput::None(_) => None,
    }
}

/// A message's `content`: a string, or an array of parts (text parts by their `text`, others as
/// JSON so that different images or files do not look alike).
fn push_content(out: &mut String, content: Option<&Value>) {
    match content {
        Some(Value::String(s)) => out.push_str(s),
        Some(Value::Array(parts)) => {
            for p in parts {
                match p.get("text").and_then(Value::as_str) {
                    Some(t) => out.push_str(t),
                    None => out.push_str(&p.to_string()),
                }
            }
        }
        Some(Value::Null) | None => {}
        Some(other) => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_tokenize::ChatRequest;
    use serde_json::json;

    fn chain(h: &TextHasher, s: &str) -> Vec<BlockHash> {
        let mut out = Vec::new();
        h.hash_text(s, &mut Vec::new(), &mut out);
        out
    }

    #[test]
    fn full_blocks_chain_and_share_prefixes() {
        let h = TextHasher::new("m", None, 4, 256);
        assert_eq!(chain(&h, "abc").len(), 0, "a partial block is not hashed");
        let a = chain(&h, "abcdefghij");
        let b = chain(&h, "abcdXXXXij");
        assert_eq!(a.len(), 2);
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        assert_eq!(a[0], hash_block(h.root(), &['a', 'b', 'c', 'd'].map(u32::from)));
        // Chained: the same second block after a different first block hashes differently.
        assert_ne!(chain(&h, "zzzzefgh")[1], a[1]);
    }

    #[test]
    fn roots_differ_by_model_adapter_and_from_token_chains() {
        let a = TextHasher::new("m", None, 4, 8);
        let b = TextHasher::new("m", Some("lora"), 4, 8);
        assert_ne!(a.root(), b.root());
        assert_ne!(a.root(), root_hash("m", None));
        assert_ne!(chain(&a, "abcd"), chain(&b, "abcd"));
    }

    #[test]
    fn blocks_are_characters_and_capped() {
        let h = TextHasher::new("m", None, 2, 3);
        assert_eq!(chain(&h, "éé").len(), 1, "two characters, four bytes: one block");
        assert_eq!(chain(&h, &"x".repeat(100)).len(), 3);
    }

    #[test]
    fn chat_text_has_roles_and_contents_in_order() {
        let chat = ChatRequest {
            messages: vec![
                json!({"role": "system", "content": "be brief"}),
                json!({"role": "user", "content": [{"type": "text", "text": "hi"}]}),
            ],
            tools: None,
        };
        let t = prompt_text(&PromptInput::Chat(chat)).unwrap();
        assert_eq!(t, "system\u{1f}be brief\u{1e}user\u{1f}hi\u{1e}");
        let swapped = ChatRequest { messages: vec![json!({"role": "user", "content": "be brief"})], tools: None };
        assert!(!prompt_text(&PromptInput::Chat(swapped)).unwrap().starts_with("system"));
        assert!(prompt_text(&PromptInput::Tokens(vec![1])).is_none());
        assert_eq!(prompt_text(&PromptInput::Text("p".into())).as_deref(), Some("p"));
    }
}
