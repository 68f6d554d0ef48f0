//! The Qwen2.5 fixture: rendered text and ids must equal what transformers/tiktoken produced
//! (tests/fixtures/tokenizer-qwen2.5, see its README), with and without the segment cache.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use kvroute_tokenize::{ChatRequest, ModelTokenizer, SegmentCacheConfig, TokenizeError, TokenizerOptions};
use serde_json::Value;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer-qwen2.5")
}

/// Loading the 8 MB tokenizer.json takes a while in debug builds: share one per test binary.
fn cached() -> &'static ModelTokenizer {
    static TOK: OnceLock<ModelTokenizer> = OnceLock::new();
    TOK.get_or_init(|| ModelTokenizer::from_dir(&fixture_dir()).unwrap())
}

fn uncached() -> &'static ModelTokenizer {
    static TOK: OnceLock<ModelTokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let opts = TokenizerOptions { segment_cache: SegmentCacheConfig { max_bytes: 0, shards: 1 } };
        ModelTokenizer::from_dir_with(&fixture_dir(), opts).unwrap()
    })
}

fn load_json(name: &str) -> serde_json::Map<String, Value> {
    let text = std::fs::read_to_string(fixture_dir().join(name)).unwrap();
    match serde_json::from_str(&text).unwrap() {
        Value::Object(m) => m,
        other => panic!("{name}: expected an object, got {other}"),
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| u32::try_from(x.as_u64().unwrap()).unwrap()).collect()
}

#[test]
fn chat_fixtures_render_and_encode_exactly() {
    let cases = load_json("expected-chat.json");
    assert_eq!(cases.len(), 5);
    for (name, case) in &cases {
        let chat: ChatRequest = serde_json::from_value(case["request"].clone()).unwrap();
        let rendered = cached().render_chat(&chat).unwrap();
        assert_eq!(rendered, case["rendered"].as_str().unwrap(), "rendered text of case {name}");
        let want = ids(&case["token_ids"]);
        assert_eq!(uncached().encode_chat(&chat).unwrap(), want, "uncached ids of case {name}");
        // Twice: the first fills the segment cache, the second is served from it.
        assert_eq!(cached().encode_chat(&chat).unwrap(), want, "cached ids (cold) of case {name}");
        assert_eq!(cached().encode_chat(&chat).unwrap(), want, "cached ids (warm) of case {name}");
    }
    assert!(cached().cache_stats().unwrap().hits > 0);
}

#[test]
fn text_fixtures_encode_exactly() {
    let cases = load_json("expected-text.json");
    assert!(cases.contains_key("empty"));
    for (name, case) in &cases {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["token_ids"]);
        assert_eq!(cached().encode_prompt(text).unwrap(), want, "encode_prompt of {name}");
        assert_eq!(uncached().encode_prompt(text).unwrap(), want, "uncached encode_prompt of {name}");
        assert_eq!(cached().encode_text(text).unwrap(), want, "encode_text of {name}");
        // Byte-level BPE round-trips.
        assert_eq!(cached().decode(&want).unwrap(), text, "decode of {name}");
    }
}

#[test]
fn special_tokens_are_kept_by_decode_and_known_by_id() {
    let tok = cached();
    assert_eq!(tok.token_id("<|im_start|>"), Some(151644));
    assert_eq!(tok.eos_token_id(), Some(151645));
    assert_eq!(tok.decode(&[151644, 872, 198, 9707, 0, 151645]).unwrap(), "<|im_start|>user\nHello!<|im_end|>");
    // Completions prompts also match special tokens (HF `tokenizer(prompt)` does).
    assert_eq!(tok.encode_prompt("<|im_start|>user").unwrap(), vec![151644, 872]);
}

/// A long conversation, one turn at a time, as a client would send it: cached ids equal uncached
/// ids at every turn, and later turns are mostly cache hits.
#[test]
fn long_multi_turn_chat_cached_equals_uncached() {
    let seed = load_json("expected-text.json")["seed_first_2000_chars"]["text"].as_str().unwrap().to_owned();
    let words: Vec<&str> = seed.split(' ').collect();
    let system = format!("{seed}\n\n{seed}");
    let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
    let tok = cached();
    let before = tok.cache_stats().unwrap();
    for turn in 0..12usize {
        let question: String =
            words.iter().cycle().skip(turn * 7).take(40 + turn * 5).copied().collect::<Vec<_>>().join(" ");
        messages.push(serde_json::json!({"role": "user", "content": format!("Turn {turn}: {question}?  \n")}));
        let chat = ChatRequest { messages: messages.clone(), tools: None };
        let text = tok.render_chat(&chat).unwrap();
        let want = uncached().encode_text_uncached(&text).unwrap();
        assert_eq!(tok.encode_chat(&chat).unwrap(), want, "turn {turn}");
        messages.push(serde_json::json!({"role": "assistant", "content": format!("Answer {turn}: {}", &question[..question.len() / 2])}));
    }
    let after = tok.cache_stats().unwrap();
    let (hits, misses) = (after.hits - before.hits, after.misses - before.misses);
    // Each turn re-uses every earlier piece; only the new user/assistant text (and fresh "\n"
    // pieces on the first turn) miss. Other tests run concurrently, so compare loosely.
    assert!(hits > 3 * misses, "hits {hits} misses {misses}");
}

#[test]
fn concurrent_use_from_many_threads_is_consistent() {
    let cases = load_json("expected-chat.json");
    let cases: Arc<Vec<(ChatRequest, Vec<u32>)>> = Arc::new(
        cases.values().map(|c| (serde_json::from_value(c["request"].clone()).unwrap(), ids(&c["token_ids"]))).collect(),
    );
    let small = Arc::new(
        ModelTokenizer::from_dir_with(
            &fixture_dir(),
            // Small budget so eviction runs while threads race.
            TokenizerOptions { segment_cache: SegmentCacheConfig { max_bytes: 1024, shards: 2 } },
        )
        .unwrap(),
    );
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let (cases, tok) = (cases.clone(), small.clone());
            std::thread::spawn(move || {
                for round in 0..20 {
                    let (chat, want) = &cases[(t + round) % cases.len()];
                    assert_eq!(&tok.encode_chat(chat).unwrap(), want);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let stats = small.cache_stats().unwrap();
    assert!(stats.hits > 0 && stats.evictions > 0, "{stats:?}");
}

#[test]
fn compact_tool_arguments_render_like_vllm() {
    // vLLM parses the JSON string and the template re-serialises it with Python's separators.
    let chat: ChatRequest = serde_json::from_value(serde_json::json!({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\",\"unit\":\"°C\"}"}}]}
    ]}))
    .unwrap();
    let text = cached().render_chat(&chat).unwrap();
    assert!(
        text.contains("{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"°C\"}}"),
        "{text}"
    );
}

#[test]
fn errors_name_the_problem() {
    let missing = ModelTokenizer::from_dir(Path::new("/nonexistent/model")).unwrap_err();
    assert!(matches!(missing, TokenizeError::Io { .. }), "{missing}");
    assert!(missing.to_string().contains("/nonexistent/model"), "{missing}");

    let dir = std::env::temp_dir().join(format!("kvroute-tokenize-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let no_file = ModelTokenizer::from_dir(&dir).unwrap_err().to_string();
    assert!(no_file.contains("tokenizer.json"), "{no_file}");

    std::fs::write(dir.join("tokenizer.json"), "{\"not\": \"a tokenizer\"}").unwrap();
    let bad_file = ModelTokenizer::from_dir(&dir).unwrap_err();
    assert!(matches!(bad_file, TokenizeError::TokenizerFile { .. }), "{bad_file}");

    std::fs::copy(fixture_dir().join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"chat_template": "{% for m in messages %}{{ m.content }"}"#)
        .unwrap();
    let bad_template = ModelTokenizer::from_dir(&dir).unwrap_err();
    let msg = bad_template.to_string();
    assert!(matches!(bad_template, TokenizeError::TemplateSyntax { .. }), "{msg}");
    assert!(msg.contains("tokenizer_config.json") && msg.contains("line 1"), "{msg}");

    std::fs::write(dir.join("tokenizer_config.json"), "{}").unwrap();
    let no_template = ModelTokenizer::from_dir(&dir).unwrap();
    let e = no_template.render_chat(&ChatRequest::default()).unwrap_err();
    assert!(matches!(e, TokenizeError::NoChatTemplate { .. }), "{e}");
    assert_eq!(no_template.encode_prompt("Hello!").unwrap(), vec![9707, 0]);

    let bad_message = ChatRequest { messages: vec![Value::from("just a string")], tools: None };
    let e = cached().encode_chat(&bad_message).unwrap_err().to_string();
    assert!(e.contains("messages[0]"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Chunk cuts (segment module docs) are exact: with 16-byte chunks, so that random texts are cut
/// at nearly every `x| y` position, piece-by-piece ids equal whole-text ids on random texts of
/// ASCII words, digits, punctuation, contractions, whitespace runs, newlines and non-ASCII.
#[test]
fn chunk_cuts_are_exact_on_random_texts() {
    use kvroute_tokenize::segment::{Piece, Segmenter};
    let tok = tokenizers::Tokenizer::from_file(fixture_dir().join("tokenizer.json")).unwrap();
    let segmenter = Segmenter::new(&tok).unwrap();
    assert!(segmenter.chunks(), "the Qwen2 pre-tokenizer is cuttable");
    let segmenter = segmenter.with_chunk_bytes(16);
    let encode = |s: &str| tok.encode_fast(s, false).unwrap().get_ids().to_vec();
    let parts = [
        "the",
        " the",
        "The",
        " cat",
        "'s",
        "'T",
        "'re",
        " don't",
        "I'M",
        " x",
        "a",
        "7",
        " 42",
        "1234",
        "  ",
        "   ",
        "\t",
        "\n",
        "\n\n",
        " \n ",
        "\r\n",
        ".",
        ",",
        "?!",
        " (",
        ")",
        "\"",
        "-",
        " é",
        "é",
        "Grüße",
        " 你好",
        "世界",
        "🙂",
        " 🚀",
        "\u{301}",
        "\u{a0}",
        "\u{3000}",
        "x\u{301}",
        " ñ",
        "ſ",
        "<|im_start|>",
        "<|im_end|>",
        "http://a.b/c?d=e",
        " word",
        " Word",
        "z",
        " Q",
    ];
    let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
    let mut cuts = 0;
    for round in 0..1500 {
        let len = 1 + next(120);
        let text: String = (0..len).map(|_| parts[next(parts.len())]).collect();
        let mut ids = Vec::new();
        let mut texts = 0;
        segmenter
            .for_each_piece(&text, |p| {
                match p {
                    Piece::Added(id) => ids.push(id),
                    Piece::Text(t) => {
                        texts += 1;
                        ids.extend(encode(t));
                    }
                }
                Ok::<_, ()>(())
            })
            .unwrap();
        cuts += texts;
        assert_eq!(ids, encode(&text), "round {round}: {text:?}");
    }
    assert!(cuts > 5000, "the texts were cut often enough to test the cuts ({cuts} pieces)");
}

/// Completions prompts that share a long prefix re-use its chunks: the second prompt misses only
/// on its last chunk(s), and its ids equal the uncached ones.
#[test]
fn shared_prefix_prompts_reuse_chunks() {
    let seed = load_json("expected-text.json")["seed_first_2000_chars"]["text"].as_str().unwrap().to_owned();
    let tok = ModelTokenizer::from_dir(&fixture_dir()).unwrap();
    let first = format!("{seed} {seed} first question here?");
    let second = format!("{seed} {seed} another question, please.");
    assert_eq!(tok.encode_prompt(&first).unwrap(), uncached().encode_prompt(&first).unwrap());
    let before = tok.cache_stats().unwrap();
    assert_eq!(tok.encode_prompt(&second).unwrap(), uncached().encode_prompt(&second).unwrap());
    let after = tok.cache_stats().unwrap();
    assert!(after.hits - before.hits >= 5, "{before:?} → {after:?}");
    assert!(after.misses - before.misses <= 2, "{before:?} → {after:?}");
}

/// splintr (used for `add_special_tokens=False` encodes once it matched at load) gives exactly
/// `tokenizers`' ids on random texts mixing words, contractions, whitespace runs, newlines, tabs,
/// digits, punctuation, added tokens, non-Latin scripts, combining marks and emoji.
#[test]
fn fast_bpe_equals_tokenizers_on_random_texts() {
    let tok = uncached();
    assert!(tok.fast_bpe(), "splintr loads the Qwen2.5 fixture and matches on the check texts");
    let parts = [
        "the",
        " the",
        "The",
        " cat",
        "'s",
        "'T",
        "'re",
        " don't",
        "I'M",
        " x",
        "a",
        "7",
        " 42",
        "123456",
        "  ",
        "   ",
        "\t",
        "\n",
        "\n\n",
        " \n ",
        "\r\n",
        "\r",
        ".",
        ",",
        "?!",
        " (",
        ")",
        "\"",
        "-",
        " é",
        "é",
        "Grüße",
        " 你好",
        "世界",
        "🙂",
        " 🚀",
        "👍🏽",
        "\u{301}",
        "\u{200b}",
        "\u{a0}",
        "\u{3000}",
        "x\u{301}",
        " ñ",
        "ſ",
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "http://a.b/c?d=e",
        "    return x;",
        "fn main() {",
        "한국어",
        " Привет",
        "ｱｲ",
        "१२",
    ];
    let mut next = xorshift(0x2545_F491_4F6C_DD1D);
    for round in 0..3000 {
        let len = 1 + next(150);
        let mut text: String = (0..len).map(|_| parts[next(parts.len())]).collect();
        if round % 3 == 0 {
            // Arbitrary scalar values too.
            text.extend((0..next(20)).filter_map(|_| char::from_u32(next(0x30000) as u32)));
        }
        assert_eq!(
            tok.encode_text(&text).unwrap(),
            tok.encode_text_uncached(&text).unwrap(),
            "round {round}: {text:?}"
        );
    }
}

/// A seeded xorshift64 source for the random-text tests: `next(n)` is in `0..n`.
fn xorshift(mut state: u64) -> impl FnMut(usize) -> usize {
    move |n| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    }
}
