//! Finds `usage.prompt_tokens_details.cached_tokens` (and `usage.completion_tokens`, for GIE's
//! output-token metric) in a response body that streams past in chunks of any size
//! (docs/design.md §5), without holding the body.
//!
//! Two shapes: a non-streaming JSON completion (usage at the top level, near the end), and an SSE
//! stream of `data: {...}` lines where the final chunk carries `usage` (when the client asked for
//! `stream_options.include_usage`). Memory is bounded: SSE keeps only the current partial line
//! (dropped past [`MAX_LINE_BYTES`]); JSON keeps the body up to [`MAX_JSON_BYTES`], then only a
//! tail of [`TAIL_BYTES`] that is scanned textually for `"cached_tokens": N` (an unescaped quote
//! cannot occur inside a JSON string, so generated text cannot fake it).

use serde::Deserialize;

/// Longest SSE line kept while waiting for its end, in bytes.
pub const MAX_LINE_BYTES: usize = 1024 * 1024;
/// Largest non-streaming body parsed as a whole, in bytes.
pub const MAX_JSON_BYTES: usize = 1024 * 1024;
/// Tail kept for the textual fallback once a JSON body outgrows [`MAX_JSON_BYTES`], in bytes.
pub const TAIL_BYTES: usize = 16 * 1024;

/// Per-response scanner. Feed every chunk in order; `finish` at end of stream.
#[derive(Debug, Default)]
pub struct UsageScanner {
    sse: Option<bool>,
    buf: Vec<u8>,
    overflowed: bool,
    found: Option<u32>,
    completion: Option<u32>,
}

impl UsageScanner {
    /// A scanner; `event_stream` from the response `content-type` when known (else sniffed).
    pub fn new(event_stream: Option<bool>) -> Self {
        Self { sse: event_stream, ..Self::default() }
    }

    /// The cached-token count once seen.
    pub fn found(&self) -> Option<u32> {
        self.found
    }

    /// `usage.completion_tokens` once seen (in the same usage object as the cached tokens).
    pub fn completion_tokens(&self) -> Option<u32> {
        self.completion
    }

    /// Feeds one chunk of the response body.
    pub fn push(&mut self, chunk: &[u8]) {
        if self.found.is_some() || chunk.is_empty() {
            return;
        }
        let sse = match self.sse {
            Some(sse) => sse,
            None => {
                // Sniffed from the first byte that is not whitespace, wherever the chunks split:
                // whitespace before it is held (up to MAX_LINE_BYTES, past which it is dropped)
                // and read as the shape it turns out to lead.
                let Some(&first) = chunk.iter().find(|b| !b.is_ascii_whitespace()) else {
                    if self.buf.len() + chunk.len() <= MAX_LINE_BYTES {
                        self.buf.extend_from_slice(chunk);
                    }
                    return;
                };
                let sse = first != b'{';
                self.sse = Some(sse);
                let held = std::mem::take(&mut self.buf);
                if sse {
                    self.push_sse(&held)
                } else {
                    self.push_json(&held)
                }
                sse
            }
        };
        if sse { self.push_sse(chunk) } else { self.push_json(chunk) }
    }

    /// Ends the body; returns the cached-token count if any was found.
    pub fn finish(&mut self) -> Option<u32> {
        if self.found.is_none() {
            if self.sse == Some(true) {
                let line = std::mem::take(&mut self.buf);
                self.sse_line(&line);
            } else if self.overflowed {
                self.found = scan_text(&self.buf, b"\"cached_tokens\"");
                self.completion = scan_text(&self.buf, b"\"completion_tokens\"");
            } else if !self.buf.is_empty() {
                (self.found, self.completion) = usage_counts(&self.buf);
            }
        }
        self.buf = Vec::new();
        self.found
    }

    fn push_sse(&mut self, chunk: &[u8]) {
        let mut rest = chunk;
        while let Some(nl) = rest.iter().position(|&b| b == b'\n') {
            let (head, tail) = rest.split_at(nl);
            rest = &tail[1..];
            if self.overflowed {
                self.overflowed = false;
                self.buf.clear();
                continue;
            }
            if self.buf.is_empty() {
                self.sse_line(head);
            } else {
                self.buf.extend_from_slice(head);
                let line = std::mem::take(&mut self.buf);
                self.sse_line(&line);
            }
            if self.found.is_some() {
                return;
            }
        }
        if !self.overflowed {
            self.buf.extend_from_slice(rest);
            if self.buf.len() > MAX_LINE_BYTES {
                self.buf.clear();
                self.overflowed = true;
            }
        }
    }

    fn sse_line(&mut self, line: &[u8]) {
        let Some(data) = line.strip_prefix(b"data:") else { return };
        let data = data.trim_ascii();
        if data.first() != Some(&b'{') || memfind(data, b"\"usage\"").is_none() {
            return;
        }
        let (cached, completion) = usage_counts(data);
        self.found = cached;
        self.completion = completion.or(self.completion);
    }

    fn push_json(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
        if !self.overflowed && self.buf.len() > MAX_JSON_BYTES {
            self.overflowed = true;
        }
        if self.overflowed && self.buf.len() > 2 * TAIL_BYTES {
            let cut = self.buf.len() - TAIL_BYTES;
            self.buf.drain(..cut);
        }
    }
}

/// The parts of a response object (a completion, or one SSE chunk) the scanner reads. Every other
/// field is skipped by the parser without being built (the generated text of a long completion
/// is never copied); a field of another type than these makes the whole object unreadable.
#[derive(Deserialize)]
struct WithUsage {
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens_details: Option<PromptTokensDetails>,
    #[serde(default)]
    completion_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct PromptTokensDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// `usage.prompt_tokens_details.cached_tokens` and `usage.completion_tokens` of a JSON response
/// object; each `None` when the text is not such an object, a level is missing or null, or the
/// count is not a `u32`.
fn usage_counts(json: &[u8]) -> (Option<u32>, Option<u32>) {
    let Some(usage) = serde_json::from_slice::<WithUsage>(json).ok().and_then(|v| v.usage) else {
        return (None, None);
    };
    let count = |n: Option<u64>| n.and_then(|n| u32::try_from(n).ok());
    (count(usage.prompt_tokens_details.and_then(|d| d.cached_tokens)), count(usage.completion_tokens))
}

/// Last `key: N` in `text` (`key` with its quotes).
fn scan_text(text: &[u8], key: &[u8]) -> Option<u32> {
    let pos = text.windows(key.len()).rposition(|w| w == key)?;
    let rest = text[pos + key.len()..].trim_ascii_start().strip_prefix(b":")?.trim_ascii_start();
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

fn memfind(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FINAL: &str = r#"data: {"id":"c","choices":[],"usage":{"prompt_tokens":40,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":32}}}"#;

    #[test]
    fn sse_split_anywhere() {
        let stream = format!(
            "data: {{\"id\":\"c\",\"choices\":[{{\"text\":\"\\\"cached_tokens\\\": 9\"}}]}}\n\n{FINAL}\n\ndata: [DONE]\n\n"
        );
        for cut in 0..stream.len() {
            let mut s = UsageScanner::new(None);
            s.push(&stream.as_bytes()[..cut]);
            s.push(&stream.as_bytes()[cut..]);
            assert_eq!(s.finish(), Some(32), "cut at {cut}");
            assert_eq!(s.completion_tokens(), Some(3), "cut at {cut}");
        }
    }

    /// A body whose first chunk is whitespace alone is read as the shape its first other byte
    /// leads, as when it arrives whole.
    #[test]
    fn whitespace_first_chunk_decides_nothing() {
        let json = r#" {"usage":{"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":16}}}"#;
        let sse = format!(" \n{FINAL}\n\n");
        let unindented = format!("  {FINAL}\n\n");
        for body in [json, sse.as_str(), unindented.as_str()] {
            let mut whole = UsageScanner::new(None);
            whole.push(body.as_bytes());
            let want = (whole.finish(), whole.completion_tokens());
            for cut in 1..body.len() {
                let mut s = UsageScanner::new(None);
                for c in body.as_bytes().chunks(cut) {
                    s.push(c);
                }
                assert_eq!((s.finish(), s.completion_tokens()), want, "{body:?} in chunks of {cut}");
            }
        }
        let mut s = UsageScanner::new(None);
        s.push(b" ");
        s.push(json.as_bytes()[1..].as_ref());
        assert_eq!(s.finish(), Some(16), "a JSON body after a whitespace chunk");
    }

    #[test]
    fn sse_without_usage() {
        let mut s = UsageScanner::new(Some(true));
        s.push(b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n");
        assert_eq!(s.finish(), None);
    }

    #[test]
    fn json_body_and_large_json_tail() {
        let body = r#"{"id":"x","choices":[{"text":"hi"}],"usage":{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":16}}}"#;
        let mut s = UsageScanner::new(Some(false));
        for c in body.as_bytes().chunks(7) {
            s.push(c);
        }
        assert_eq!(s.finish(), Some(16));

        let big = format!(
            r#"{{"choices":[{{"text":"{}"}}],"usage":{{"completion_tokens": 7,"prompt_tokens_details":{{"cached_tokens": 48}}}}}}"#,
            "a".repeat(3 * MAX_JSON_BYTES)
        );
        let mut s = UsageScanner::new(None);
        for c in big.as_bytes().chunks(65536) {
            s.push(c);
        }
        assert_eq!(s.finish(), Some(48));
        assert_eq!(s.completion_tokens(), Some(7), "from the kept tail");
    }

    #[test]
    fn only_a_whole_integer_usage_counts() {
        let cases: [(&[u8], Option<u32>); 7] = [
            (br#"{"choices":[{"text":"\"usage\":{\"cached_tokens\": 7}"}],"usage":null}"#, None),
            (br#"{"usage":"none"}"#, None),
            (br#"{"usage":{"prompt_tokens_details":{"cached_tokens":3.5}}}"#, None),
            (br#"{"usage":{"prompt_tokens_details":{"cached_tokens":4294967296}}}"#, None),
            (br#"{"usage":{"prompt_tokens_details":{"cached_tokens":4294967295}}}"#, Some(u32::MAX)),
            (
                br#"{"id":1,"object":{"a":[1,{"b":null}]},"usage":{"prompt_tokens_details":{"cached_tokens":0}}}"#,
                Some(0),
            ),
            (br#"{"usage":{"prompt_tokens_details":{"cached_tokens":16}}"#, None),
        ];
        for (body, want) in cases {
            let mut s = UsageScanner::new(Some(false));
            s.push(body);
            assert_eq!(s.finish(), want, "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn null_details_give_none() {
        let mut s = UsageScanner::new(None);
        s.push(br#"{"usage":{"prompt_tokens":5,"prompt_tokens_details":null}}"#);
        assert_eq!(s.finish(), None);
    }
}
