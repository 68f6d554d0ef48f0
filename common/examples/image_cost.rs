//! Cost of reproducing one inline image on the picker (docs/design.md §2): strict base64 decode,
//! header size, Qwen2-VL count and vLLM's content hash of a 1 MiB and an 8 MiB PNG payload,
//! against the same run's 4,096-token block chain as the baseline.
//!
//! `cargo run --release -p kvroute-common --features image --example image_cost`

// A measurement program: its inputs are built here, a failure is a bug worth a panic.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use base64::Engine as _;
use kvroute_common::image::*;
use std::time::Instant;
/// Prints one line per payload size: per-image time, baseline time, their ratio.
fn main() {
    for mb in [1usize, 8] {
        let mut bytes = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR\0\0\x0f\xa0\0\0\x0b\xb8\x08\x02\0\0\0".to_vec();
        bytes.resize(mb << 20, 7);
        let url = format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(&bytes));
        let hasher = kvroute_common::BlockHasher::new("m", None, 16);
        let toks: Vec<u32> = (0..4096).collect();
        let n = 20;
        let t = Instant::now();
        for _ in 0..n {
            let b = decode_base64(data_url_payload(&url).unwrap(), 64 << 20).unwrap();
            let (w, h) = image_size(&b).unwrap();
            std::hint::black_box((SmartResize::QWEN2_VL.tokens(w, h), content_identifier("m", &b)));
        }
        let img = t.elapsed().as_secs_f64() / n as f64;
        let t = Instant::now();
        let mut out = Vec::new();
        for _ in 0..n * 50 {
            out.clear();
            hasher.hash_prompt(std::hint::black_box(&toks), &mut out);
        }
        let base = t.elapsed().as_secs_f64() / (n * 50) as f64;
        println!(
            "{mb} MiB image: {:.3} ms; 4096-token chain: {:.4} ms; ratio {:.0}x",
            img * 1e3,
            base * 1e3,
            img / base
        );
    }
}
