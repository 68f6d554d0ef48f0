//! Chat template rendering with minijinja, matching transformers' `apply_chat_template`
//! (Jinja2 `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` + loop controls)
//! and vLLM's request preprocessing.
//!
//! Differences from minijinja's defaults that change prompt bytes, and so token ids:
//! - `tojson` is transformers' (`ensure_ascii=False, indent=None, separators=None, sort_keys=False`,
//!   i.e. Python's `json.dumps`: `", "`/`": "`, key order kept, no HTML escaping).
//! - `{{ x }}` prints `None`/`True`/`False` and Python reprs of lists and dicts, as Jinja2 does.
//! - Python string/dict methods (`.strip()`, `.items()`, ...) via minijinja-contrib's `pycompat`.
//! - `raise_exception(msg)` fails the render with `msg`; `strftime_now(fmt)` formats UTC now.
//! - vLLM parses assistant `tool_calls[].function.arguments` JSON strings into objects before
//!   rendering (empty ones become `{}`; an empty `tool_calls` list is removed), so templates that
//!   `tojson` them see objects.
//!
//! Concurrency: the environment is built once and only read afterwards (`Send + Sync`).

use std::path::Path;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::value::{Kwargs, Value};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Output, State, UndefinedBehavior};

use crate::pyjson::{self, DumpOptions};
use crate::strftime::UtcTime;
use crate::{ChatRequest, TokenizeError};

const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template and the special-token strings it is given.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `(name, text)` of the special tokens passed as template variables (`bos_token`, ...).
    special_tokens: Vec<(&'static str, String)>,
}

impl ChatTemplate {
    /// Compiles `source`; `path` names its file in errors.
    pub fn new(source: &str, path: &Path, special_tokens: Vec<(&'static str, String)>) -> Result<Self, TokenizeError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| TokenizeError::TemplateSyntax { path: path.to_owned(), message: describe(&e) })?;
        env.set_syntax(syntax);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", |fmt: &str| UtcTime::now().format(fmt));
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(|e| TokenizeError::TemplateSyntax { path: path.to_owned(), message: describe(&e) })?;
        Ok(Self { env, special_tokens })
    }

    /// Renders `chat` with `add_generation_prompt = true`, as vLLM's chat endpoint does.
    pub fn render(&self, chat: &ChatRequest) -> Result<String, TokenizeError> {
        let messages = preprocess_messages(&chat.messages)?;
        let messages: &[serde_json::Value] = messages.as_deref().unwrap_or(&chat.messages);
        let mut ctx: Vec<(&str, Value)> = vec![
            ("messages", Value::from(Serde(messages))),
            ("tools", chat.tools.as_ref().map_or(Value::from(()), |t| Value::from(Serde(t)))),
            ("documents", Value::from(())),
            ("add_generation_prompt", Value::from(true)),
        ];
        for (name, text) in &self.special_tokens {
            ctx.push((name, Value::from(text.as_str())));
        }
        let ctx = Value::from_pairs(ctx);
        let template = self.env.get_template(TEMPLATE_NAME).map_err(|e| TokenizeError::Render(describe(&e)))?;
        template.render(ctx).map_err(|e| TokenizeError::Render(describe(&e)))
    }
}

/// minijinja's error text plus the template location and detail, on one line.
fn describe(e: &Error) -> String {
    let mut msg = e.to_string();
    if let Some(detail) = e.detail()
        && !msg.contains(detail)
    {
        msg = format!("{msg}: {detail}");
    }
    if let (Some(line), false) = (e.line(), msg.contains("line")) {
        msg = format!("{msg} (line {line})");
    }
    msg
}

/// vLLM's `_postprocess_messages`: assistant tool-call arguments given as JSON text become objects
/// (empty or null ones become `{}`, an empty `tool_calls` list is dropped), so templates see what
/// transformers' docs require. `None` when no message needs a change (the common case: the
/// messages are rendered as they are, without a deep copy of every turn's text).
fn preprocess_messages(messages: &[serde_json::Value]) -> Result<Option<Vec<serde_json::Value>>, TokenizeError> {
    let mut changed = false;
    for (i, message) in messages.iter().enumerate() {
        let serde_json::Value::Object(obj) = message else {
            return Err(TokenizeError::InvalidRequest(format!("messages[{i}] is not an object")));
        };
        changed |= obj.get("role").and_then(|r| r.as_str()) == Some("assistant") && obj.contains_key("tool_calls");
    }
    if !changed {
        return Ok(None);
    }
    let mut out = messages.to_vec();
    for (i, message) in out.iter_mut().enumerate() {
        let serde_json::Value::Object(obj) = message else { continue };
        if obj.get("role").and_then(|r| r.as_str()) != Some("assistant") {
            continue;
        }
        if obj.get("tool_calls").and_then(|c| c.as_array()).is_some_and(|c| c.is_empty()) {
            // vLLM drops an empty list so templates take the plain assistant path.
            obj.shift_remove("tool_calls");
            continue;
        }
        let Some(serde_json::Value::Array(calls)) = obj.get_mut("tool_calls") else { continue };
        for call in calls {
            let Some(serde_json::Value::Object(function)) = call.get_mut("function") else { continue };
            let parsed = match function.get("arguments") {
                None | Some(serde_json::Value::Null) => serde_json::Value::Object(Default::default()),
                Some(serde_json::Value::String(s)) if s.is_empty() => serde_json::Value::Object(Default::default()),
                Some(serde_json::Value::String(s)) => match serde_json::from_str(s) {
                    Ok(v) => v,
                    Err(e) => {
                        return Err(TokenizeError::InvalidRequest(format!(
                            "messages[{i}].tool_calls[].function.arguments is not valid JSON: {e}"
                        )));
                    }
                },
                Some(_) => continue,
            };
            function.insert("arguments".to_owned(), parsed);
        }
    }
    Ok(Some(out))
}

/// Jinja2 prints Python values: `None`, `True`, `['a', 1]`; strings and numbers print as usual.
fn python_formatter(out: &mut Output, state: &mut State, value: &Value) -> Result<(), Error> {
    use minijinja::value::ValueKind;
    match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Seq | ValueKind::Map => {
            let mut s = String::new();
            pyjson::py_repr(&mut s, value);
            out.write_str(&s).map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string()))
        }
        ValueKind::Number if !value.is_integer() => {
            let s =
                f64::try_from(value.clone()).map_or_else(|_| value.to_string(), |f| pyjson::py_float_repr(f, false));
            out.write_str(&s).map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string()))
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: &Value, ensure_ascii: Option<Value>, indent: Option<Value>, kwargs: Kwargs) -> Result<String, Error> {
    let ensure_ascii = match kwargs.get::<Option<bool>>("ensure_ascii")? {
        Some(b) => b,
        None => ensure_ascii.is_some_and(|v| v.is_true()),
    };
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        Some(v) => Some(v),
        None => indent,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_str(), i64::try_from(v.clone())) {
            (Some(s), _) => Some(s.to_owned()),
            (None, Ok(n)) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
            _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an int or a string")),
        },
    };
    let mut opts = DumpOptions {
        ensure_ascii,
        item_sep: if indent.is_some() { ",".into() } else { ", ".into() },
        indent,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ..DumpOptions::default()
    };
    if let Some(seps) = kwargs.get::<Option<Value>>("separators")?
        && !seps.is_none()
    {
        let parts: Vec<Value> = seps.try_iter()?.collect();
        match parts.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                opts.item_sep = item.as_str().unwrap_or_default().to_owned();
                opts.key_sep = key.as_str().unwrap_or_default().to_owned();
            }
            _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings")),
        }
    }
    kwargs.assert_all_used()?;
    pyjson::dumps(value, &opts)
}

fn raise_exception(message: &str) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, format!("raise_exception: {message}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, chat: serde_json::Value) -> Result<String, TokenizeError> {
        let t = ChatTemplate::new(src, Path::new("t.jinja"), vec![("bos_token", "<s>".into())])?;
        let chat: ChatRequest = serde_json::from_value(chat).unwrap();
        t.render(&chat)
    }

    #[test]
    fn python_printing_and_methods() {
        let src = "{{ bos_token }}{% for m in messages %}{{ m.content.strip() }}|{{ m.x }}|{{ m.flag }}|{{ m.l }}\n{% endfor %}";
        let out = render(
            src,
            serde_json::json!({"messages": [{"role": "user", "content": "  hi  ", "x": null, "flag": true, "l": ["a", 1]}]}),
        )
        .unwrap();
        assert_eq!(out, "<s>hi|None|True|['a', 1]\n");
    }

    #[test]
    fn tojson_signature_and_tool_call_arguments() {
        let src = "{% for m in messages %}{% for c in m.tool_calls %}{{ c.function.arguments | tojson }}|{{ c.function.arguments | tojson(indent=2, sort_keys=true) }}|{{ c.function.arguments | tojson(separators=(',', ':')) }}{% endfor %}{% endfor %}";
        let chat = serde_json::json!({"messages": [{"role": "assistant", "content": null,
            "tool_calls": [{"function": {"name": "f", "arguments": "{\"z\":\"é<\",\"a\":[1,2]}"}}]}]});
        let out = render(src, chat).unwrap();
        assert_eq!(
            out,
            "{\"z\": \"é<\", \"a\": [1, 2]}|{\n  \"a\": [\n    1,\n    2\n  ],\n  \"z\": \"é<\"\n}|{\"z\":\"é<\",\"a\":[1,2]}"
        );
    }

    #[test]
    fn raise_exception_and_syntax_errors_are_clear() {
        let e =
            render("{{ raise_exception('Roles must alternate') }}", serde_json::json!({"messages": []})).unwrap_err();
        assert!(e.to_string().contains("Roles must alternate"), "{e}");
        let e = ChatTemplate::new("{% for x in %}", Path::new("/m/tokenizer_config.json"), vec![]).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, TokenizeError::TemplateSyntax { .. }), "{msg}");
        assert!(msg.contains("/m/tokenizer_config.json") && msg.contains("line 1"), "{msg}");
    }

    #[test]
    fn bad_tool_arguments_are_a_clear_error() {
        let chat = serde_json::json!({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]});
        let e = render("x", chat).unwrap_err().to_string();
        assert!(e.contains("arguments is not valid JSON"), "{e}");
    }
}
