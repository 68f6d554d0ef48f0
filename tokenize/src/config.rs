//! The parts of a HuggingFace model directory's `tokenizer_config.json` (and `chat_template.jinja`)
//! that change what the engine computes: the chat template and the special-token strings the
//! template sees. Parsed once at load; immutable afterwards.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use crate::TokenizeError;

/// Special tokens and chat template of a model directory.
#[derive(Debug, Clone, Default)]
pub struct TokenizerConfig {
    /// `bos_token` as text (`None` when null or absent: the template then sees it undefined).
    pub bos_token: Option<String>,
    /// `eos_token` as text.
    pub eos_token: Option<String>,
    /// `pad_token` as text.
    pub pad_token: Option<String>,
    /// `unk_token` as text.
    pub unk_token: Option<String>,
    /// `add_bos_token`, if the file states it (informational: the post-processor of
    /// `tokenizer.json` decides what `encode_prompt` adds, as in transformers' fast tokenizers).
    pub add_bos_token: Option<bool>,
    /// The Jinja chat template source and the file it came from.
    pub chat_template: Option<(String, PathBuf)>,
}

impl TokenizerConfig {
    /// Reads `dir/tokenizer_config.json` (optional: a missing file gives no template and no special
    /// tokens) and `dir/chat_template.jinja` (which wins over the JSON's `chat_template`, as in
    /// transformers ≥ 4.43, which saves templates there).
    pub fn load(dir: &Path) -> Result<Self, TokenizeError> {
        let path = dir.join("tokenizer_config.json");
        let mut config = match std::fs::read_to_string(&path) {
            Ok(text) => Self::parse(&text, &path)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Self::default(),
            Err(source) => return Err(TokenizeError::Io { path, source }),
        };
        let jinja = dir.join("chat_template.jinja");
        match std::fs::read_to_string(&jinja) {
            Ok(text) => config.chat_template = Some((text, jinja)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(TokenizeError::Io { path: jinja, source }),
        }
        Ok(config)
    }

    /// Parses the text of a `tokenizer_config.json`; `path` is used in error messages only.
    pub fn parse(text: &str, path: &Path) -> Result<Self, TokenizeError> {
        let err = |message: String| TokenizeError::Config { path: path.to_owned(), message };
        let json: Json = serde_json::from_str(text).map_err(|e| err(format!("not valid JSON: {e}")))?;
        let Json::Object(obj) = &json else {
            return Err(err("expected a JSON object at the top level".into()));
        };
        let token = |name: &str| -> Result<Option<String>, TokenizeError> {
            match obj.get(name) {
                None | Some(Json::Null) => Ok(None),
                Some(Json::String(s)) => Ok(Some(s.clone())),
                Some(Json::Object(o)) => match o.get("content") {
                    Some(Json::String(s)) => Ok(Some(s.clone())),
                    _ => Err(err(format!("`{name}` is an object without a string `content` field"))),
                },
                Some(other) => {
                    Err(err(format!("`{name}` must be a string, null or {{\"content\": ...}}, got {other}")))
                }
            }
        };
        let add_bos_token = match obj.get("add_bos_token") {
            None | Some(Json::Null) => None,
            Some(Json::Bool(b)) => Some(*b),
            Some(other) => return Err(err(format!("`add_bos_token` must be a boolean, got {other}"))),
        };
        let chat_template = match obj.get("chat_template") {
            None | Some(Json::Null) => None,
            Some(Json::String(s)) => Some(s.clone()),
            // Older multi-template form: [{"name": "default", "template": "..."}, ...].
            Some(Json::Array(list)) => {
                let named = |want: &str| {
                    list.iter().find_map(|t| {
                        (t.get("name").and_then(Json::as_str) == Some(want))
                            .then(|| t.get("template").and_then(Json::as_str))
                            .flatten()
                    })
                };
                Some(
                    named("default")
                        .ok_or_else(|| err("`chat_template` is a list without a template named \"default\"".into()))?
                        .to_owned(),
                )
            }
            Some(other) => return Err(err(format!("`chat_template` must be a string, got {other}"))),
        };
        Ok(Self {
            bos_token: token("bos_token")?,
            eos_token: token("eos_token")?,
            pad_token: token("pad_token")?,
            unk_token: token("unk_token")?,
            add_bos_token,
            chat_template: chat_template.map(|t| (t, path.to_owned())),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_as_strings_or_objects() {
        let c = TokenizerConfig::parse(
            r#"{"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>", "unk_token": null,
                "add_bos_token": true, "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#,
            Path::new("x.json"),
        )
        .unwrap();
        assert_eq!(c.bos_token.as_deref(), Some("<s>"));
        assert_eq!(c.eos_token.as_deref(), Some("</s>"));
        assert_eq!(c.unk_token, None);
        assert_eq!(c.add_bos_token, Some(true));
        assert_eq!(c.chat_template.map(|t| t.0).as_deref(), Some("D"));
    }

    #[test]
    fn bad_fields_are_named() {
        let e = TokenizerConfig::parse(r#"{"eos_token": 5}"#, Path::new("cfg.json")).unwrap_err().to_string();
        assert!(e.contains("cfg.json") && e.contains("eos_token"), "{e}");
        let e = TokenizerConfig::parse("{nope", Path::new("cfg.json")).unwrap_err().to_string();
        assert!(e.contains("not valid JSON"), "{e}");
    }
}
