//! Measures what a picker decision pays for tokenization on the Qwen2.5 fixture (docs/design.md §10):
//! a 4096-token text encoded whole, and a growing multi-turn chat through the segment cache.
//!
//! `cargo run -p kvroute-tokenize --example tokenize_cost [--release] [MODEL_DIR]`
//! Prints medians over 20 runs. A measurement tool, not a test.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvroute_tokenize::{ChatRequest, ModelTokenizer};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn time<T>(runs: usize, mut f: impl FnMut() -> T) -> Duration {
    median(
        (0..runs)
            .map(|_| {
                let t = Instant::now();
                std::hint::black_box(f());
                t.elapsed()
            })
            .collect(),
    )
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args().nth(1).map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer-qwen2.5"),
        PathBuf::from,
    );
    let t = Instant::now();
    let tok = ModelTokenizer::from_dir(&dir)?;
    println!("load: {:?}", t.elapsed());

    // The fixture's seed excerpt (first 2000 characters of the design doc), repeated.
    let expected: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected-text.json"))?)?;
    let seed = expected["seed_first_2000_chars"]["text"].as_str().unwrap_or("The quick brown fox. ").to_owned();
    let mut text = String::new();
    while tok.encode_text_uncached(&text)?.len() < 4096 {
        text.push_str(&seed);
    }
    let ids = tok.encode_text_uncached(&text)?;
    let cut = ids[..4096].to_vec();
    let text = tok.decode(&cut)?;
    println!("text: {} chars, {} tokens", text.len(), tok.encode_text_uncached(&text)?.len());
    println!("whole encode (tokenizers, cold): {:?}", time(20, || tok.encode_text_uncached(&text)));

    // A chat: 3000-token system prompt, then turns; measure turn N+1 after turn N was seen.
    let system = tok.decode(&cut[..3000])?;
    let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
    for turn in 0..8 {
        let q = tok.decode(&cut[3000 + turn * 100..3000 + turn * 100 + 60])?;
        messages.push(serde_json::json!({"role": "user", "content": q}));
        let chat = ChatRequest { messages: messages.clone(), tools: None };
        let t = Instant::now();
        let n = tok.encode_chat(&chat)?.len();
        println!("turn {turn}: {n} tokens, first sight {:?}", t.elapsed());
        println!(
            "turn {turn}: repeat {:?}, render only {:?}",
            time(20, || tok.encode_chat(&chat)),
            time(20, || tok.render_chat(&chat))
        );
        messages.push(serde_json::json!({"role": "assistant", "content": tok.decode(&cut[3060 + turn * 100..3090 + turn * 100])?}));
    }
    println!("cache: {:?}", tok.cache_stats());
    Ok(())
}
