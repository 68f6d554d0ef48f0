//! Label and field selectors as the API server parses them (`labelSelector=`, `fieldSelector=`
//! query parameters).
//!
//! Label grammar (k8s.io/apimachinery `labels.Parse`): comma-separated requirements, each one of
//! `key`, `!key`, `key=value`, `key==value`, `key!=value`, `key in (a,b)`, `key notin (a,b)`.
//! Field grammar (`fields.ParseSelector`): `path=value`, `path==value`, `path!=value`, comma-separated;
//! only the paths a resource supports are accepted (others are a 400, as upstream).

use serde_json::Value;

/// A selector that could not be parsed, with the API server's wording where it has one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SelectorError(pub String);

/// One label requirement.
#[derive(Debug, Clone, PartialEq, Eq)]
enum LabelRequirement {
    Exists(String),
    NotExists(String),
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A parsed label selector; empty matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector {
    requirements: Vec<LabelRequirement>,
}

impl LabelSelector {
    /// Parses the `labelSelector` query value.
    ///
    /// # Errors
    /// A requirement that is not one of the forms above.
    pub fn parse(s: &str) -> Result<Self, SelectorError> {
        let mut requirements = Vec::new();
        for part in split_top_level(s) {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            requirements.push(parse_label_requirement(part)?);
        }
        Ok(Self { requirements })
    }

    /// Whether `labels` (an object's `metadata.labels`, absent = none) satisfies every requirement.
    pub fn matches(&self, labels: Option<&serde_json::Map<String, Value>>) -> bool {
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.requirements.iter().all(|r| match r {
            LabelRequirement::Exists(k) => get(k).is_some(),
            LabelRequirement::NotExists(k) => get(k).is_none(),
            LabelRequirement::Equals(k, v) => get(k) == Some(v.as_str()),
            LabelRequirement::NotEquals(k, v) => get(k) != Some(v.as_str()),
            LabelRequirement::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            LabelRequirement::NotIn(k, vs) => get(k).is_none_or(|x| !vs.iter().any(|v| v == x)),
        })
    }
}

/// Splits at commas that are not inside `( … )`.
fn split_top_level(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

fn valid_key(k: &str) -> bool {
    !k.is_empty() && k.len() <= 317 && k.chars().all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
}

fn parse_label_requirement(part: &str) -> Result<LabelRequirement, SelectorError> {
    let bad = || SelectorError(format!("unable to parse requirement: {part:?}"));
    if let Some(k) = part.strip_prefix('!') {
        let k = k.trim();
        return if valid_key(k) { Ok(LabelRequirement::NotExists(k.to_string())) } else { Err(bad()) };
    }
    for (op, neg) in [("!=", true), ("==", false), ("=", false)] {
        if let Some((k, v)) = part.split_once(op) {
            let (k, v) = (k.trim(), v.trim());
            if !valid_key(k) {
                return Err(bad());
            }
            return Ok(if neg {
                LabelRequirement::NotEquals(k.into(), v.into())
            } else {
                LabelRequirement::Equals(k.into(), v.into())
            });
        }
    }
    for (op, neg) in [(" notin ", true), (" in ", false)] {
        if let Some((k, rest)) = part.split_once(op) {
            let k = k.trim();
            let rest = rest.trim();
            let inner = rest.strip_prefix('(').and_then(|r| r.strip_suffix(')')).ok_or_else(bad)?;
            let values: Vec<String> =
                inner.split(',').map(|v| v.trim().to_string()).filter(|v| !v.is_empty()).collect();
            if !valid_key(k) || values.is_empty() {
                return Err(bad());
            }
            return Ok(if neg {
                LabelRequirement::NotIn(k.into(), values)
            } else {
                LabelRequirement::In(k.into(), values)
            });
        }
    }
    if valid_key(part) { Ok(LabelRequirement::Exists(part.to_string())) } else { Err(bad()) }
}

/// One field requirement: a supported path, equal or not to a value.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FieldRequirement {
    path: String,
    value: String,
    negate: bool,
}

/// A parsed field selector; empty matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector {
    requirements: Vec<FieldRequirement>,
}

impl FieldSelector {
    /// Parses the `fieldSelector` query value against the paths the resource supports.
    ///
    /// # Errors
    /// Malformed requirement; or `field label not supported: PATH` (the API server's message).
    pub fn parse(s: &str, supported: &[&str]) -> Result<Self, SelectorError> {
        let mut requirements = Vec::new();
        for part in s.split(',') {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            let (path, value, negate) = if let Some((p, v)) = part.split_once("!=") {
                (p, v, true)
            } else if let Some((p, v)) = part.split_once("==") {
                (p, v, false)
            } else if let Some((p, v)) = part.split_once('=') {
                (p, v, false)
            } else {
                return Err(SelectorError(format!("invalid selector: '{part}'; can't understand '{part}'")));
            };
            let path = path.trim();
            if !supported.contains(&path) {
                return Err(SelectorError(format!("field label not supported: {path}")));
            }
            requirements.push(FieldRequirement { path: path.into(), value: value.trim().into(), negate });
        }
        Ok(Self { requirements })
    }

    /// Whether `object` satisfies every requirement; an absent field reads as `""`, a boolean as
    /// `true`/`false` (as the API server's field-label conversion does).
    pub fn matches(&self, object: &Value) -> bool {
        self.requirements.iter().all(|r| {
            let mut v = object;
            let mut found = true;
            for seg in r.path.split('.') {
                match v.get(seg) {
                    Some(x) => v = x,
                    None => {
                        found = false;
                        break;
                    }
                }
            }
            let actual = match (found, v) {
                (false, _) | (true, Value::Null) => String::new(),
                (true, Value::String(s)) => s.clone(),
                (true, Value::Bool(b)) => b.to_string(),
                (true, other) => other.to_string(),
            };
            (actual == r.value) != r.negate
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn labels(v: Value) -> serde_json::Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn label_forms_match_as_upstream() {
        let l = labels(json!({"app": "vllm", "tier": "gpu", "rank": "0"}));
        let cases = [
            ("", true),
            ("app=vllm", true),
            ("app==vllm,tier=gpu", true),
            ("app=vllm,tier=cpu", false),
            ("app!=vllm", false),
            ("missing!=x", true),
            ("app in (vllm, sglang)", true),
            ("app notin (vllm)", false),
            ("app in (sglang,vllm),tier", true),
            ("app in (a,b),tier", false),
            ("!tier", false),
            ("!missing", true),
            ("missing", false),
        ];
        for (sel, want) in cases {
            assert_eq!(LabelSelector::parse(sel).unwrap().matches(Some(&l)), want, "{sel}");
        }
        assert!(!LabelSelector::parse("app=vllm").unwrap().matches(None));
        assert!(LabelSelector::parse("app in vllm").is_err());
        assert!(LabelSelector::parse("a b=c").is_err());
    }

    #[test]
    fn field_selector_reads_paths_and_rejects_unsupported() {
        let pod = json!({"metadata": {"name": "p"}, "spec": {"nodeName": "n1", "hostNetwork": false}});
        let supported = ["metadata.name", "spec.nodeName", "spec.hostNetwork", "status.podIP"];
        let m = |s: &str| FieldSelector::parse(s, &supported).unwrap().matches(&pod);
        assert!(m("spec.nodeName=n1"));
        assert!(!m("spec.nodeName=n2"));
        assert!(m("spec.nodeName!=n2,metadata.name==p"));
        assert!(m("status.podIP="), "absent field reads as empty");
        assert!(m("spec.hostNetwork=false"));
        let err = FieldSelector::parse("spec.bogus=1", &supported).unwrap_err();
        assert_eq!(err.0, "field label not supported: spec.bogus");
    }
}
