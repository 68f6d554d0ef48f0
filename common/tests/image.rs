//! Real encoder output (tests/fixtures/images, see its README) through the header readers and
//! the Qwen2-VL token count, by data URL as a client sends them.

#![cfg(feature = "image")]

use base64::Engine as _;
use kvroute_common::image::{SmartResize, content_identifier, data_url_payload, decode_base64, image_size};

fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{}/../tests/fixtures/images/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn data_url(media_type: &str, bytes: &[u8]) -> String {
    format!("data:{media_type};base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

#[test]
fn real_images_by_data_url() {
    // (file, media type as a client would label it, size as Pillow 13.0.0 reports it, tokens
    // worked by hand in the README).
    let cases = [
        ("gradient-300x200.png", "image/png", (300, 200), 77),
        ("pattern-130x90-progressive-exif.jpg", "image/jpeg", (130, 90), 15),
        ("photo-200x150-lossy.webp", "image/webp", (200, 150), 35),
        ("gradient-180x120-lossless.webp", "image/webp", (180, 120), 24),
        ("anim-100x80-3frames.webp", "image/webp", (100, 80), 12),
        ("anim-150x100-2frames.gif", "image/gif", (150, 100), 20),
        ("pattern-90x60.bmp", "image/bmp", (90, 60), 6),
    ];
    for (name, media_type, size, tokens) in cases {
        let bytes = fixture(name);
        let url = data_url(media_type, &bytes);
        let decoded = decode_base64(data_url_payload(&url).expect("a data URL"), 1 << 20).expect("strict base64");
        assert_eq!(decoded, bytes, "{name}");
        assert_eq!(image_size(&decoded), Some(size), "{name}");
        assert_eq!(SmartResize::QWEN2_VL.tokens(size.0, size.1), Some(tokens), "{name}");
        // vLLM hashes the bytes as sent, so the label does not matter but every byte does.
        let id = content_identifier("Qwen/Qwen2.5-VL-3B-Instruct", &decoded);
        let mut other = decoded.clone();
        *other.last_mut().unwrap() ^= 1;
        assert_ne!(id, content_identifier("Qwen/Qwen2.5-VL-3B-Instruct", &other), "{name}");
    }
}

/// The WebP fixtures are the three kinds of first chunk, and a real file cut anywhere is refused
/// (libwebp refuses a file shorter than its RIFF size), while bytes after it are ignored.
#[test]
fn real_webp_kinds_and_truncation() {
    for (name, fourcc) in [
        ("photo-200x150-lossy.webp", b"VP8 "),
        ("gradient-180x120-lossless.webp", b"VP8L"),
        ("anim-100x80-3frames.webp", b"VP8X"),
    ] {
        let bytes = fixture(name);
        assert_eq!(&bytes[12..16], fourcc, "{name}");
        for cut in [0, 12, 20, 30, bytes.len() / 2, bytes.len() - 1] {
            assert_eq!(image_size(&bytes[..cut]), None, "{name} cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.extend_from_slice(&[0; 7]);
        assert_eq!(image_size(&longer), image_size(&bytes), "{name}");
    }
}
