//! Images sent inline, as vLLM sees them (docs/design.md §2 "images"): the picker must key an
//! image's blocks with the identifier the engine gives it and expand its placeholder to the
//! engine's token count, and the emulator stands in for that engine, so both use this one
//! implementation.
//!
//! - [`data_url_payload`]: the base64 payload of a `data:<type>;base64,<payload>` URL.
//! - [`decode_base64`]: that payload's bytes, decoded as strictly as vLLM does, bounded.
//! - [`image_size`]: width and height from a PNG (IHDR) or JPEG (SOF) header, without decoding
//!   pixels; anything else is `None`.
//! - [`content_identifier`]: vLLM's multimodal hash of an image it loaded from bytes (BLAKE3 over
//!   a framed serialization of the model id and the image's original bytes; 64 hex digits).
//! - [`SmartResize`]: the Qwen2-VL family's token count for an image of a given size.
//!
//! Every function is total: malformed input yields `None`, never a panic, and work is linear in
//! the input with no allocation beyond the decoded bytes.

use base64::Engine as _;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};

/// Most pixels (width × height) vLLM loads; a larger image is refused (Pillow's decompression-bomb
/// limit, 2 × 89,478,485, which vLLM also applies as `VLLM_MAX_IMAGE_PIXELS`' default).
pub const MAX_IMAGE_PIXELS: u64 = 178_956_970;

/// Largest long-side / short-side ratio the Qwen2-VL processor accepts (it raises above it).
pub const MAX_ASPECT_RATIO: f64 = 200.0;

/// The base64 payload of a data URL (`data:<media type>;base64,<payload>`), `None` for any other
/// URL. vLLM accepts any media type here (Pillow recognizes the image by its bytes) but only the
/// base64 encoding. The payload is not validated.
pub fn data_url_payload(url: &str) -> Option<&str> {
    let rest = url.strip_prefix("data:")?;
    let (spec, payload) = rest.split_once(',')?;
    let (_media_type, encoding) = spec.split_once(';')?;
    (encoding == "base64").then_some(payload)
}

/// vLLM decodes with `validate=True`: the standard alphabet only (no whitespace, no URL-safe
/// characters), padding required; trailing bits are not checked.
const STRICT: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new()
        .with_decode_allow_trailing_bits(true)
        .with_decode_padding_mode(DecodePaddingMode::RequireCanonical),
);

/// The bytes `payload` encodes, or `None` when it is not strict base64 (see [`data_url_payload`])
/// or would decode to more than `max_bytes` (checked before decoding).
pub fn decode_base64(payload: &str, max_bytes: usize) -> Option<Vec<u8>> {
    if payload.len() / 4 * 3 > max_bytes.saturating_add(2) {
        return None;
    }
    let bytes = STRICT.decode(payload).ok()?;
    (bytes.len() <= max_bytes).then_some(bytes)
}

/// (width, height) in pixels from a PNG or JPEG header; `None` for another format, a truncated or
/// malformed header, or a zero dimension. Reads only up to the header (for JPEG, up to the first
/// start-of-frame segment).
pub fn image_size(bytes: &[u8]) -> Option<(u32, u32)> {
    const PNG: &[u8] = b"\x89PNG\r\n\x1a\n";
    let size = if bytes.starts_with(PNG) {
        // Signature, then the IHDR chunk: length 13, type, width and height big-endian.
        if bytes.get(12..16)? != b"IHDR" {
            return None;
        }
        (be32(bytes, 16)?, be32(bytes, 20)?)
    } else if bytes.starts_with(&[0xFF, 0xD8]) {
        jpeg_size(bytes)?
    } else {
        return None;
    };
    (size.0 > 0 && size.1 > 0).then_some(size)
}

fn be32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn be16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

/// Walks the JPEG's marker segments to the first start-of-frame (SOF0–SOF15 but DHT, JPG, DAC),
/// whose payload holds precision, height, width. Each step advances, so the walk is bounded by
/// the input's length.
fn jpeg_size(b: &[u8]) -> Option<(u32, u32)> {
    let mut at = 2;
    loop {
        if *b.get(at)? != 0xFF {
            return None;
        }
        // Fill bytes: any number of 0xFF before the marker code.
        while *b.get(at + 1)? == 0xFF {
            at += 1;
        }
        let marker = *b.get(at + 1)?;
        at += 2;
        match marker {
            // Markers without a length: TEM, RSTn. SOI again or EOI/SOS before a frame: malformed.
            0x01 | 0xD0..=0xD7 => continue,
            0xD8 | 0xD9 | 0xDA | 0x00 => return None,
            0xC0..=0xCF if !matches!(marker, 0xC4 | 0xC8 | 0xCC) => {
                let height = be16(b, at + 3)?;
                let width = be16(b, at + 5)?;
                return Some((u32::from(width), u32::from(height)));
            }
            _ => {
                let len = usize::from(be16(b, at)?);
                if len < 2 {
                    return None;
                }
                at += len;
            }
        }
    }
}

/// Length prefix of every framed chunk of vLLM's hash input (u64 little-endian).
fn framed(hasher: &mut blake3::Hasher, chunk: &[u8]) {
    hasher.update(&(chunk.len() as u64).to_le_bytes());
    hasher.update(chunk);
}

/// Tag before every leaf value of vLLM's hash input.
const TAG_LEAF: u8 = 0x03;

/// vLLM's identifier for an image loaded from `image` (the bytes a data URL decodes to) under the
/// engine's model `model_id` (the `model` it was started with, not a served name), when the
/// request carries no `uuid`, no `mm_processor_kwargs` and the engine no `--media-io-kwargs`:
/// the lowercase hex BLAKE3 digest (64 digits) of, keys in sorted order,
///
/// ```text
/// frame("image") 0x03 frame("image") 0x03 frame(image bytes) frame("model_id") 0x03 frame(model_id)
/// frame(x) = len(x) as u64 LE ‖ x
/// ```
///
/// (the item is vLLM's `MediaWithBytes`, serialized as its original bytes under the key
/// "image"; docs/design.md §2 cites the source this was read from).
pub fn content_identifier(model_id: &str, image: &[u8]) -> String {
    let mut h = blake3::Hasher::new();
    framed(&mut h, b"image");
    h.update(&[TAG_LEAF]);
    framed(&mut h, b"image");
    h.update(&[TAG_LEAF]);
    framed(&mut h, image);
    framed(&mut h, b"model_id");
    h.update(&[TAG_LEAF]);
    framed(&mut h, model_id.as_bytes());
    h.finalize().to_hex().to_string()
}

/// The Qwen2-VL family's image resizing (its image processor's `smart_resize`) and token count:
/// both sides rounded to multiples of `patch_size × merge_size`, the area brought into
/// [`min_pixels`, `max_pixels`] keeping the aspect ratio, then one token per
/// `merge_size²` patches of `patch_size²` pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SmartResize {
    /// Side of a vision patch, in pixels (14 for Qwen2-VL and Qwen2.5-VL).
    pub patch_size: u32,
    /// Patches merged per side into one token (2).
    pub merge_size: u32,
    /// Smallest area after resizing, in pixels (the processor's `min_pixels`).
    pub min_pixels: u64,
    /// Largest area after resizing, in pixels (the processor's `max_pixels`).
    pub max_pixels: u64,
}

impl SmartResize {
    /// The values of Qwen2-VL-*-Instruct's and Qwen2.5-VL-*-Instruct's `preprocessor_config.json`:
    /// patch 14, merge 2, min 3,136 (56²), max 12,845,056 (16,384 × 28²) pixels.
    pub const QWEN2_VL: SmartResize =
        SmartResize { patch_size: 14, merge_size: 2, min_pixels: 56 * 56, max_pixels: 16_384 * 28 * 28 };

    /// (height, width) after resizing an image of `width` × `height` pixels; `None` where the
    /// processor (or vLLM's loader) refuses the image: a zero side, more than
    /// [`MAX_IMAGE_PIXELS`], an aspect ratio over [`MAX_ASPECT_RATIO`]. The floating-point steps
    /// are those of the reference (IEEE doubles, Python's round-half-to-even), so results agree
    /// at the rounding boundaries too.
    pub fn resize(&self, width: u32, height: u32) -> Option<(u64, u64)> {
        let factor = u64::from(self.patch_size).checked_mul(u64::from(self.merge_size))?;
        let area = u64::from(width) * u64::from(height);
        if factor == 0 || area == 0 || area > MAX_IMAGE_PIXELS {
            return None;
        }
        let (h, w, f) = (f64::from(height), f64::from(width), factor as f64);
        if h.max(w) / h.min(w) > MAX_ASPECT_RATIO {
            return None;
        }
        // Bounded: sides ≤ MAX_IMAGE_PIXELS, so every product below fits u64 and f64 exactly.
        let mut h_bar = (h / f).round_ties_even() as u64 * factor;
        let mut w_bar = (w / f).round_ties_even() as u64 * factor;
        if h_bar * w_bar > self.max_pixels {
            let beta = (area as f64 / self.max_pixels as f64).sqrt();
            h_bar = factor.max((h / beta / f).floor() as u64 * factor);
            w_bar = factor.max((w / beta / f).floor() as u64 * factor);
        } else if h_bar * w_bar < self.min_pixels {
            let beta = (self.min_pixels as f64 / area as f64).sqrt();
            h_bar = (h * beta / f).ceil() as u64 * factor;
            w_bar = (w * beta / f).ceil() as u64 * factor;
        }
        Some((h_bar, w_bar))
    }

    /// Tokens an image of `width` × `height` pixels becomes: (resized height / patch) × (resized
    /// width / patch) / merge². `None` as for [`SmartResize::resize`].
    pub fn tokens(&self, width: u32, height: u32) -> Option<usize> {
        let (h, w) = self.resize(width, height)?;
        let patch = u64::from(self.patch_size);
        let merge = u64::from(self.merge_size);
        usize::try_from((h / patch) * (w / patch) / (merge * merge)).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 1×1 PNG header with the given size (signature, IHDR; no pixel data needed for the size).
    fn png(width: u32, height: u32) -> Vec<u8> {
        let mut b = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
        b.extend_from_slice(&width.to_be_bytes());
        b.extend_from_slice(&height.to_be_bytes());
        b.extend_from_slice(&[8, 2, 0, 0, 0, 0, 0, 0, 0]);
        b
    }

    /// A JPEG whose frame header comes after an APP0 and a DQT-like segment and fill bytes.
    fn jpeg(width: u16, height: u16, sof: u8) -> Vec<u8> {
        let mut b = vec![0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x10];
        b.extend_from_slice(b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0");
        b.extend_from_slice(&[0xFF, 0xFF, 0xDB, 0x00, 0x04, 0x00, 0x00]);
        b.extend_from_slice(&[0xFF, sof, 0x00, 0x11, 0x08]);
        b.extend_from_slice(&height.to_be_bytes());
        b.extend_from_slice(&width.to_be_bytes());
        b.extend_from_slice(&[3, 1, 0x22, 0, 2, 0x11, 1, 3, 0x11, 1]);
        b
    }

    #[test]
    fn data_urls_are_base64_only() {
        assert_eq!(data_url_payload("data:image/png;base64,QUJD"), Some("QUJD"));
        assert_eq!(data_url_payload("data:image/jpeg;base64,"), Some(""));
        assert_eq!(data_url_payload("data:image/png,QUJD"), None);
        assert_eq!(data_url_payload("data:image/png;utf8,QUJD"), None);
        assert_eq!(data_url_payload("https://example.com/a.png"), None);
        assert_eq!(decode_base64("QUJD", 16).as_deref(), Some(&b"ABC"[..]));
        assert_eq!(decode_base64("QUI=", 16).as_deref(), Some(&b"AB"[..]));
        // vLLM's strict decoding refuses these; so does the picker.
        for bad in ["QUI", "QU JD", "QUJD\n", "QU-D", "Q===", "!!!!"] {
            assert_eq!(decode_base64(bad, 16), None, "{bad:?}");
        }
        assert_eq!(decode_base64("QUJDRA==", 3), None, "over the bound");
        assert_eq!(decode_base64(&"QUJD".repeat(1000), 100), None, "refused before decoding");
    }

    #[test]
    fn sizes_from_png_and_jpeg_headers() {
        assert_eq!(image_size(&png(640, 480)), Some((640, 480)));
        assert_eq!(image_size(&jpeg(1000, 700, 0xC0)), Some((1000, 700)));
        assert_eq!(image_size(&jpeg(33, 4000, 0xC2)), Some((33, 4000)), "progressive");
        assert_eq!(image_size(&png(0, 480)), None);
        assert_eq!(image_size(&jpeg(10, 0, 0xC0)), None);
        // A DHT segment (0xC4) is not a frame header: it is skipped.
        let mut dht = jpeg(20, 30, 0xC0);
        dht.splice(2..2, [0xFF, 0xC4, 0x00, 0x02]);
        assert_eq!(image_size(&dht), Some((20, 30)));
        // Every truncation of a valid header is refused, never a panic.
        for full in [png(640, 480), jpeg(1000, 700, 0xC1)] {
            let header_end = if full[0] == 0x89 { 24 } else { full.len() - 10 };
            for cut in 0..header_end {
                assert_eq!(image_size(&full[..cut]), None, "cut at {cut}");
            }
        }
        assert_eq!(image_size(b"GIF89a\x01\0\x01\0"), None, "other formats");
        // A segment length that points backwards or nowhere ends the walk.
        assert_eq!(image_size(&[0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x01]), None);
        assert_eq!(image_size(&[0xFF, 0xD8, 0xFF, 0xE0, 0xFF, 0xFF]), None);
    }

    /// Expected counts worked by hand from the reference formula (docs/design.md §2): round each
    /// side to a multiple of 28 (half to even), rescale into [min, max] pixels, then
    /// (h/14)·(w/14)/4 tokens.
    #[test]
    fn qwen2_vl_token_counts() {
        let q = SmartResize::QWEN2_VL;
        // 448×448: 16·28 each side, in range: 32·32/4 = 256.
        assert_eq!(q.resize(448, 448), Some((448, 448)));
        assert_eq!(q.tokens(448, 448), Some(256));
        // 1000 wide × 700 high: 700 = 25·28; 1000/28 = 35.71 → 36·28 = 1008; 50·72/4 = 900.
        assert_eq!(q.resize(1000, 700), Some((700, 1008)));
        assert_eq!(q.tokens(1000, 700), Some(900));
        // Ties go to even: 42/28 = 1.5 → 2, 70/28 = 2.5 → 2 (round-half-up would give 84 wide).
        assert_eq!(q.resize(70, 42), Some((56, 56)));
        assert_eq!(q.tokens(70, 42), Some(4));
        // 4000×3000: 3000/28 = 107.1 → 2996; 4000/28 = 142.9 → 4004; 11,995,984 px ≤ max:
        // 214·286/4 = 15,301 tokens.
        assert_eq!(q.tokens(4000, 3000), Some(15_301));
        // Under the processor class's own default max (28²·1280 = 1,003,520 px): beta =
        // sqrt(12e6 / 1,003,520) = 3.458; floor(3000/3.458/28) = 30 → 840, floor(4000/3.458/28)
        // = 41 → 1148: 60·82/4 = 1,230.
        let class_default = SmartResize { max_pixels: 28 * 28 * 1280, ..q };
        assert_eq!(class_default.resize(4000, 3000), Some((840, 1148)));
        assert_eq!(class_default.tokens(4000, 3000), Some(1230));
        // Tiny: 20×20 rounds to 28×28 = 784 < 3,136: beta = sqrt(3136/400) = 2.8, ceil(20·2.8/28)
        // = 2 → 56×56: 4 tokens.
        assert_eq!(q.tokens(20, 20), Some(4));
        // Refused as vLLM refuses them.
        assert_eq!(q.tokens(0, 10), None);
        assert_eq!(q.tokens(201 * 10, 10), None, "aspect ratio over 200");
        assert_eq!(q.tokens(200 * 10, 10), Some(q.tokens(2000, 10).unwrap()));
        assert_eq!(q.tokens(20_000, 20_000), None, "over the pixel limit");
        assert_eq!(q.tokens(u32::MAX, u32::MAX), None);
        assert_eq!(SmartResize { patch_size: 0, ..q }.tokens(448, 448), None);
    }

    proptest::proptest! {
        /// Hostile headers: any bytes after a PNG or JPEG signature are read without a panic, and a
        /// size comes back only with both sides non-zero.
        #[test]
        fn any_header_is_read_without_panic(tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..96), jpeg: bool) {
            let mut bytes = if jpeg { vec![0xFF, 0xD8] } else { b"\x89PNG\r\n\x1a\n".to_vec() };
            bytes.extend_from_slice(&tail);
            if let Some((w, h)) = image_size(&bytes) {
                proptest::prop_assert!(w > 0 && h > 0);
            }
            let text = String::from_utf8_lossy(&tail);
            let _ = decode_base64(&text, 64);
        }

        /// Any size: refused, or resized to multiples of 28 within Qwen2-VL's pixel bounds.
        #[test]
        fn any_size_resizes_within_bounds(width in 1u32..20_000, height in 1u32..20_000) {
            let q = SmartResize::QWEN2_VL;
            if let Some((h, w)) = q.resize(width, height) {
                proptest::prop_assert!(h % 28 == 0 && w % 28 == 0 && h >= 28 && w >= 28);
                proptest::prop_assert!(h * w <= q.max_pixels && q.tokens(width, height).is_some());
            }
        }
    }

    /// The hash input written out byte by byte, independently of the implementation.
    #[test]
    fn content_identifier_hashes_vllms_framed_layout() {
        let image = b"\x89PNG fake bytes";
        let mut stream = Vec::new();
        stream.extend_from_slice(&[5, 0, 0, 0, 0, 0, 0, 0]);
        stream.extend_from_slice(b"image\x03");
        stream.extend_from_slice(&[5, 0, 0, 0, 0, 0, 0, 0]);
        stream.extend_from_slice(b"image\x03");
        stream.extend_from_slice(&[image.len() as u8, 0, 0, 0, 0, 0, 0, 0]);
        stream.extend_from_slice(image);
        stream.extend_from_slice(&[8, 0, 0, 0, 0, 0, 0, 0]);
        stream.extend_from_slice(b"model_id\x03");
        stream.extend_from_slice(&[27, 0, 0, 0, 0, 0, 0, 0]);
        stream.extend_from_slice(b"Qwen/Qwen2.5-VL-7B-Instruct");
        let id = content_identifier("Qwen/Qwen2.5-VL-7B-Instruct", image);
        assert_eq!(id, blake3::hash(&stream).to_hex().as_str());
        assert_eq!(id.len(), 64);
        assert!(id.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)));
        assert_ne!(id, content_identifier("Qwen/Qwen2-VL-7B-Instruct", image), "the model is part of it");
        assert_ne!(id, content_identifier("Qwen/Qwen2.5-VL-7B-Instruct", b"\x89PNG other bytes"));
    }
}
