//! Python-compatible serialisation of template values: `json.dumps` (for transformers' `tojson`
//! filter) and `repr` (for `{{ value }}` of lists, dicts, `None` and booleans, as Jinja2 prints them).
//!
//! Why: chat templates put tool schemas into the prompt with `tojson`, and the engine renders them
//! with Python. minijinja's own `tojson` is compact (`","`/`":"`) and HTML-escapes `<>&'`; any byte
//! of difference changes the token ids and so the block hashes. Pure functions, no shared state.

use std::fmt::Write as _;

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// Options of Python's `json.dumps` that transformers' `tojson` forwards.
#[derive(Debug, Clone)]
pub struct DumpOptions {
    /// `ensure_ascii`: escape every non-ASCII character as `\uXXXX` (transformers' default: false).
    pub ensure_ascii: bool,
    /// `indent`: `None` for one line, else the string put once per nesting level after a newline.
    pub indent: Option<String>,
    /// Item separator (Python default `", "`, or `","` when `indent` is set).
    pub item_sep: String,
    /// Key separator (Python default `": "`).
    pub key_sep: String,
    /// `sort_keys`: sort object keys (by their string form).
    pub sort_keys: bool,
}

impl Default for DumpOptions {
    fn default() -> Self {
        Self { ensure_ascii: false, indent: None, item_sep: ", ".into(), key_sep: ": ".into(), sort_keys: false }
    }
}

/// `json.dumps(value, **opts)` with Python's exact formatting.
pub fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, Error> {
    let mut out = String::new();
    dump_into(&mut out, value, opts, 0)?;
    Ok(out)
}

fn newline_indent(out: &mut String, opts: &DumpOptions, depth: usize) {
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

fn dump_into(out: &mut String, value: &Value, opts: &DumpOptions, depth: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Undefined => {
            return Err(Error::new(
                ErrorKind::UndefinedError,
                "tojson: value is undefined (Python: not JSON serializable)",
            ));
        }
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value),
        ValueKind::String => write_json_str(out, value.as_str().unwrap_or_default(), opts.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(out, opts, depth + 1);
                dump_into(out, item, opts, depth + 1)?;
            }
            newline_indent(out, opts, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((key_string(&key)?, item));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(out, opts, depth + 1);
                write_json_str(out, key, opts.ensure_ascii);
                out.push_str(&opts.key_sep);
                dump_into(out, item, opts, depth + 1)?;
            }
            newline_indent(out, opts, depth);
            out.push('}');
        }
        other => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a value of kind {other} is not JSON serializable"),
            ));
        }
    }
    Ok(())
}

/// Python turns int/float/bool/None keys into strings; anything else is a TypeError.
fn key_string(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::Number => {
            let mut s = String::new();
            write_number(&mut s, key);
            Ok(s)
        }
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_owned()),
        ValueKind::None => Ok("null".to_owned()),
        other => Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: keys must be str, not {other}"))),
    }
}

fn write_number(out: &mut String, value: &Value) {
    if value.is_integer() {
        // Integers print exactly (i128 covers every integer minijinja holds).
        match i128::try_from(value.clone()) {
            Ok(i) => {
                let _ = write!(out, "{i}");
            }
            Err(_) => {
                let _ = write!(out, "{value}");
            }
        }
    } else {
        match f64::try_from(value.clone()) {
            Ok(f) => out.push_str(&py_float_repr(f, true)),
            Err(_) => {
                let _ = write!(out, "{value}");
            }
        }
    }
}

/// Python's `repr(float)` (shortest round-trip digits; exponent form outside 1e-4 ≤ |x| < 1e16).
/// `json` selects JSON's spelling of non-finite values (`NaN`, `Infinity`) instead of `nan`, `inf`.
pub fn py_float_repr(f: f64, json: bool) -> String {
    if f.is_nan() {
        return if json { "NaN".into() } else { "nan".into() };
    }
    if f.is_infinite() {
        let s = if json { "Infinity" } else { "inf" };
        return if f < 0.0 { format!("-{s}") } else { s.into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // `{:e}` gives the shortest round-trip digits: "-1.2345e-7".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = mantissa.strip_prefix('-').map_or(("", mantissa), |m| ("-", m));
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // position of the decimal point within `digits`
        let body = if point <= 0 {
            format!("0.{}{}", "0".repeat(point.unsigned_abs() as usize), digits)
        } else if (point as usize) >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        format!("{sign}{body}")
    } else {
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{exp_sign}{:02}", exp.unsigned_abs())
    }
}

/// A JSON string literal with Python's escaping (`ensure_ascii` escapes everything outside
/// printable ASCII, with surrogate pairs above U+FFFF; otherwise only `"`, `\` and controls).
fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr` of a template value: `None`, `True`, `'text'`, `[1, 'a']`, `{'k': 1.0}`.
pub fn py_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::None => out.push_str("None"),
        ValueKind::Undefined => {}
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number if !value.is_integer() => match f64::try_from(value.clone()) {
            Ok(f) => out.push_str(&py_float_repr(f, false)),
            Err(_) => {
                let _ = write!(out, "{value}");
            }
        },
        ValueKind::String => py_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            out.push('[');
            if let Ok(items) = value.try_iter() {
                for (i, item) in items.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr(out, &item);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = value.try_iter() {
                for (i, key) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr(out, &key);
                    out.push_str(": ");
                    py_repr(out, &value.get_item(&key).unwrap_or_default());
                }
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

fn py_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json_value(s: &str) -> Value {
        let v: serde_json::Value = serde_json::from_str(s).unwrap();
        Value::from(minijinja::value::Serde(&v))
    }

    #[test]
    fn dumps_matches_python_defaults() {
        let v = json_value(r#"{"b": [1, 2.5, true, null], "a": "x<y>&'z", "é": "日本", "e": {}, "l": []}"#);
        // Python: json.dumps(v, ensure_ascii=False)
        assert_eq!(
            dumps(&v, &DumpOptions::default()).unwrap(),
            r#"{"b": [1, 2.5, true, null], "a": "x<y>&'z", "é": "日本", "e": {}, "l": []}"#
        );
    }

    #[test]
    fn dumps_ensure_ascii_indent_sort() {
        let v = json_value(r#"{"b": ["🙂\n"], "a": 1}"#);
        let opts = DumpOptions {
            ensure_ascii: true,
            indent: Some("  ".into()),
            item_sep: ",".into(),
            key_sep: ": ".into(),
            sort_keys: true,
        };
        // Python: json.dumps(v, ensure_ascii=True, indent=2, sort_keys=True)
        assert_eq!(dumps(&v, &opts).unwrap(), "{\n  \"a\": 1,\n  \"b\": [\n    \"\\ud83d\\ude42\\n\"\n  ]\n}");
    }

    #[test]
    fn float_repr_like_python() {
        assert_eq!(py_float_repr(1.0, true), "1.0");
        assert_eq!(py_float_repr(0.1, true), "0.1");
        assert_eq!(py_float_repr(1e16, true), "1e+16");
        assert_eq!(py_float_repr(1.5e-5, true), "1.5e-05");
        assert_eq!(py_float_repr(0.0001, true), "0.0001");
        assert_eq!(py_float_repr(123456.789, true), "123456.789");
        assert_eq!(py_float_repr(-2.5e20, true), "-2.5e+20");
        assert_eq!(py_float_repr(f64::NAN, true), "NaN");
    }

    #[test]
    fn repr_like_python() {
        let v = json_value(r#"[null, true, "it's", {"k": 1.0}]"#);
        let mut s = String::new();
        py_repr(&mut s, &v);
        assert_eq!(s, r#"[None, True, "it's", {'k': 1.0}]"#);
    }
}
