//! Parser for vLLM's Prometheus text exposition (`/metrics`, format 0.0.4 as written by Python's
//! `prometheus_client`), reduced to the few series the agent needs.
//!
//! The parser is small and strict: every non-comment line must be `name{labels} value [timestamp]`
//! with well-formed quoting, or the whole page is rejected with [`MetricsError`] (a half-parsed page
//! could silently report an idle engine). It is pure and allocation-light; no shared state.
//!
//! Work is bounded: a page of more than [`MAX_LINES`] lines is rejected before its lines are
//! parsed (a page of a million series would cost a core at one scrape per 200 ms,
//! docs/decisions/0024-bounded-outside-input.md); the page's bytes are bounded by the reader
//! ([`super::scrape::ReadLimits`]).
//!
//! Aggregation over vLLM's `engine` label (data-parallel ranks): request counts are summed,
//! `kv_cache_usage_perc` takes the maximum (the fullest rank limits admission).
//! `vllm:lora_requests_info` is a gauge whose value is a Unix timestamp; vLLM leaves older label
//! sets behind, so the current one is the series with the LARGEST value.

/// Errors while parsing a `/metrics` page.
#[derive(Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum MetricsError {
    /// A sample line did not follow the text format.
    #[error("line {line}: {reason}: {text:?}")]
    Malformed {
        /// 1-based line number in the page.
        line: usize,
        /// What was wrong.
        reason: &'static str,
        /// The offending line (truncated to 120 chars).
        text: String,
    },
    /// The page has more lines than [`MAX_LINES`]: not parsed.
    #[error("page has more than {0} lines: not parsed")]
    TooManyLines(usize),
    /// The page parsed but lacks a series the agent cannot work without.
    #[error("missing series {0} (is this a vLLM /metrics page?)")]
    Missing(&'static str),
}

/// Most lines of a page parsed (vLLM's page has 100–5 000: more with data-parallel ranks and
/// adapters). At this bound a page parses in about 5 ms.
pub const MAX_LINES: usize = 100_000;

/// One sample: metric name, label pairs, value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name, e.g. `vllm:num_requests_running`.
    pub name: String,
    /// Label pairs in page order (values unescaped).
    pub labels: Vec<(String, String)>,
    /// Sample value.
    pub value: f64,
}

impl Sample {
    /// The value of label `key`, if present.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// LoRA state from `vllm:lora_requests_info`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoraInfo {
    /// Adapters loaded and serving requests.
    pub running: Vec<String>,
    /// Adapters requested but waiting to be loaded.
    pub waiting: Vec<String>,
    /// `--max-loras`: adapters the engine can hold at once.
    pub max_lora: u32,
}

/// What the agent reads from one `/metrics` page.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineMetrics {
    /// `vllm:num_requests_running`, summed over engines (requests).
    pub num_requests_running: u32,
    /// `vllm:num_requests_waiting`, summed over engines (requests).
    pub num_requests_waiting: u32,
    /// `vllm:kv_cache_usage_perc`, max over engines, in [0,1].
    pub kv_cache_usage: f64,
    /// `block_size` label of `vllm:cache_config_info` (tokens per block), if present.
    pub block_size: Option<u32>,
    /// `num_gpu_blocks` label of `vllm:cache_config_info` (blocks), if present.
    pub num_gpu_blocks: Option<u64>,
    /// `vllm:lora_requests_info`'s current series; `None` when LoRA is not enabled.
    pub lora: Option<LoraInfo>,
    /// `vllm:prompt_tokens_total` + `vllm:generation_tokens_total`, summed over engines (tokens
    /// processed since the engine started); `None` when neither is on the page. Rising between
    /// two scrapes = the engine is making progress (tells a busy engine from a stuck one).
    pub tokens_processed: Option<f64>,
}

/// One sample line, borrowed from the page: the labels are checked but kept raw (between the
/// braces, values still escaped), so lines the agent does not read cost no allocation
/// (allocating every name and label of every line would be most of a scrape's parse,
/// docs/decisions/0023-agent-cpu-budget.md).
#[derive(Debug, Clone, Copy)]
struct LineRef<'a> {
    name: &'a str,
    labels: &'a str,
    value: f64,
}

impl<'a> LineRef<'a> {
    /// The value of label `key`, unescaped; `None` when absent.
    fn label(&self, key: &str) -> Option<String> {
        let mut found = None;
        // The labels were checked when the line was parsed: this scan cannot fail.
        let _ = scan_labels(self.labels, |k, raw| {
            if found.is_none() && k == key {
                found = Some(unescape(raw));
            }
        });
        found
    }
}

/// Walks every non-comment line, checking each; `each` sees the parsed lines in page order.
fn for_each_line<'a>(text: &'a str, mut each: impl FnMut(LineRef<'a>)) -> Result<(), MetricsError> {
    // Counting newlines first is one byte scan, far cheaper than parsing the lines it refuses.
    if text.bytes().filter(|&b| b == b'\n').count() >= MAX_LINES {
        return Err(MetricsError::TooManyLines(MAX_LINES));
    }
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        each(parse_line(line).map_err(|reason| MetricsError::Malformed {
            line: i + 1,
            reason,
            text: line.chars().take(120).collect(),
        })?);
    }
    Ok(())
}

/// Parses every sample line of a text-format page. Comments and blank lines are skipped.
pub fn parse_samples(text: &str) -> Result<Vec<Sample>, MetricsError> {
    let mut out = Vec::new();
    for_each_line(text, |l| {
        let mut labels = Vec::new();
        let _ = scan_labels(l.labels, |k, raw| labels.push((k.to_string(), unescape(raw))));
        out.push(Sample { name: l.name.to_string(), labels, value: l.value });
    })?;
    Ok(out)
}

fn parse_line(line: &str) -> Result<LineRef<'_>, &'static str> {
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace()).ok_or("no value")?;
    let name = &line[..name_end];
    if name.is_empty() || !name.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b':') {
        return Err("bad metric name");
    }
    let mut rest = &line[name_end..];
    let mut labels = "";
    if let Some(after) = rest.strip_prefix('{') {
        let tail = scan_labels(after, |_, _| {})?;
        labels = &after[..after.len() - tail.len()];
        rest = tail;
    }
    let mut fields = rest.split_whitespace();
    let value = fields.next().ok_or("no value")?;
    let value = parse_value(value).ok_or("bad value")?;
    if let Some(ts) = fields.next() {
        ts.parse::<i64>().map_err(|_| "bad timestamp")?;
    }
    if fields.next().is_some() {
        return Err("trailing fields");
    }
    Ok(LineRef { name, labels, value })
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => s.parse().ok(),
    }
}

/// Checks `k="v",k2="v2"}` and returns what follows the `}`; `each` gets every key and raw
/// (still escaped) value, borrowed.
fn scan_labels<'a>(mut s: &'a str, mut each: impl FnMut(&'a str, &'a str)) -> Result<&'a str, &'static str> {
    loop {
        s = s.trim_start();
        if let Some(tail) = s.strip_prefix('}') {
            return Ok(tail);
        }
        let eq = s.find('=').ok_or("label without '='")?;
        let key = s[..eq].trim();
        if key.is_empty() || !key.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_') {
            return Err("bad label name");
        }
        s = s[eq + 1..].trim_start().strip_prefix('"').ok_or("label value not quoted")?;
        let mut bytes = s.bytes().enumerate();
        let end = loop {
            match bytes.next() {
                None => return Err("unterminated label value"),
                Some((i, b'"')) => break i,
                Some((_, b'\\')) => match bytes.next() {
                    Some((_, b'n' | b'\\' | b'"')) => {}
                    _ => return Err("bad escape in label value"),
                },
                Some(_) => {}
            }
        };
        each(key, &s[..end]);
        s = s[end + 1..].trim_start();
        if let Some(tail) = s.strip_prefix(',') {
            s = tail;
        } else if !s.starts_with('}') {
            return Err("expected ',' or '}' after label");
        }
    }
}

/// A label value with its escapes (`\n`, `\\`, `\"`: checked when the line was parsed) resolved.
fn unescape(raw: &str) -> String {
    if !raw.contains('\\') {
        return raw.to_string();
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
        } else if let Some(e) = chars.next() {
            out.push(if e == 'n' { '\n' } else { e });
        }
    }
    out
}

fn split_list(s: &str) -> Vec<String> {
    s.split(',').map(str::trim).filter(|x| !x.is_empty()).map(str::to_string).collect()
}

/// Parses a vLLM `/metrics` page into [`EngineMetrics`]. `vllm:num_requests_running`,
/// `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` are required.
pub fn parse_engine_metrics(text: &str) -> Result<EngineMetrics, MetricsError> {
    let mut m = EngineMetrics::default();
    let (mut seen_run, mut seen_wait, mut seen_kv) = (false, false, false);
    let mut lora_best: Option<LineRef<'_>> = None;
    for_each_line(text, |s| match s.name {
        "vllm:num_requests_running" => {
            seen_run = true;
            m.num_requests_running = m.num_requests_running.saturating_add(to_count(s.value));
        }
        "vllm:num_requests_waiting" => {
            seen_wait = true;
            m.num_requests_waiting = m.num_requests_waiting.saturating_add(to_count(s.value));
        }
        "vllm:kv_cache_usage_perc" => {
            seen_kv = true;
            if s.value.is_finite() {
                m.kv_cache_usage = m.kv_cache_usage.max(s.value.clamp(0.0, 1.0));
            }
        }
        "vllm:cache_config_info" => {
            m.block_size = s.label("block_size").and_then(|v| v.parse().ok()).or(m.block_size);
            m.num_gpu_blocks = s.label("num_gpu_blocks").and_then(|v| v.parse().ok()).or(m.num_gpu_blocks);
        }
        "vllm:lora_requests_info" if lora_best.is_none_or(|b| s.value > b.value) => lora_best = Some(s),
        "vllm:prompt_tokens_total" | "vllm:generation_tokens_total" if s.value.is_finite() => {
            m.tokens_processed = Some(m.tokens_processed.unwrap_or(0.0) + s.value);
        }
        _ => {}
    })?;
    if !seen_run {
        return Err(MetricsError::Missing("vllm:num_requests_running"));
    }
    if !seen_wait {
        return Err(MetricsError::Missing("vllm:num_requests_waiting"));
    }
    if !seen_kv {
        return Err(MetricsError::Missing("vllm:kv_cache_usage_perc"));
    }
    m.lora = lora_best.map(|s| LoraInfo {
        running: split_list(&s.label("running_lora_adapters").unwrap_or_default()),
        waiting: split_list(&s.label("waiting_lora_adapters").unwrap_or_default()),
        max_lora: s.label("max_lora").and_then(|v| v.parse().ok()).unwrap_or(0),
    });
    Ok(m)
}

fn to_count(v: f64) -> u32 {
    if v.is_finite() && v > 0.0 { v.round().min(u32::MAX as f64) as u32 } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> String {
        let p = format!("{}/../tests/fixtures/vllm-metrics/{name}", env!("CARGO_MANIFEST_DIR"));
        std::fs::read_to_string(p).expect("fixture readable")
    }

    #[test]
    fn busy_lora_page() {
        let m = parse_engine_metrics(&fixture("vllm-metrics-busy-lora.txt")).expect("parses");
        assert_eq!(m.num_requests_running, 7);
        assert_eq!(m.num_requests_waiting, 3);
        assert!((m.kv_cache_usage - 0.4213).abs() < 1e-9);
        assert_eq!(m.block_size, Some(16));
        assert_eq!(m.num_gpu_blocks, Some(27910));
        let lora = m.lora.expect("lora info");
        assert_eq!(lora.running, vec!["sql-lora", "chat-lora"]);
        assert_eq!(lora.waiting, vec!["billing-lora"]);
        assert_eq!(lora.max_lora, 4);
        // prompt 302 211 + generation 91 234 tokens.
        assert_eq!(m.tokens_processed, Some(393_445.0));
    }

    #[test]
    fn idle_page_has_no_lora() {
        let m = parse_engine_metrics(&fixture("vllm-metrics-idle-nolora.txt")).expect("parses");
        assert_eq!(m.num_requests_running, 0);
        assert_eq!(m.num_requests_waiting, 0);
        assert_eq!(m.lora, None);
        assert_eq!(m.block_size, Some(16));
    }

    #[test]
    fn data_parallel_ranks_aggregate() {
        let page = "vllm:num_requests_running{engine=\"0\"} 2\nvllm:num_requests_running{engine=\"1\"} 3\n\
                    vllm:num_requests_waiting{engine=\"0\"} 1\nvllm:num_requests_waiting{engine=\"1\"} 4\n\
                    vllm:kv_cache_usage_perc{engine=\"0\"} 0.2\nvllm:kv_cache_usage_perc{engine=\"1\"} 0.7\n";
        let m = parse_engine_metrics(page).expect("parses");
        assert_eq!((m.num_requests_running, m.num_requests_waiting), (5, 5));
        assert!((m.kv_cache_usage - 0.7).abs() < 1e-12);
    }

    #[test]
    fn broken_pages_are_errors() {
        for page in [
            "vllm:num_requests_running{engine=\"0\" 7\n",
            "vllm:num_requests_running{engine=\"0\"} seven\n",
            "vllm:num_requests_running{engine=0} 7\n",
            "<html>502 Bad Gateway</html>\n",
            "vllm:num_requests_running 1 2 3 4\n",
        ] {
            assert!(matches!(parse_engine_metrics(page), Err(MetricsError::Malformed { .. })), "{page}");
        }
        assert_eq!(parse_engine_metrics("up 1\n"), Err(MetricsError::Missing("vllm:num_requests_running")));
        let full = fixture("vllm-metrics-busy-lora.txt");
        let truncated = &full[..full.len() / 2];
        // A page cut mid-line either fails to parse or lacks series; it never panics.
        let _ = parse_engine_metrics(truncated);
    }

    #[test]
    fn a_page_of_a_million_series_is_refused_before_it_is_parsed() {
        let mut page = fixture("vllm-metrics-busy-lora.txt");
        for i in 0..1_000_000 {
            page.push_str(&format!("x{i} 1\n"));
        }
        assert_eq!(parse_engine_metrics(&page), Err(MetricsError::TooManyLines(MAX_LINES)));
        // Just under the bound, the page parses.
        let mut page = fixture("vllm-metrics-busy-lora.txt");
        let lines = page.lines().count();
        for i in 0..MAX_LINES - lines - 1 {
            page.push_str(&format!("x{i} 1\n"));
        }
        assert_eq!(parse_engine_metrics(&page).map(|m| m.num_requests_running), Ok(7));
    }

    #[test]
    fn escaped_label_values() {
        let s = parse_samples("m{a=\"x\\\"y\\\\z\\n\",b=\"\"} 1 1700000000000\n").expect("parses");
        assert_eq!(s[0].label("a"), Some("x\"y\\z\n"));
        assert_eq!(s[0].label("b"), Some(""));
    }
}
