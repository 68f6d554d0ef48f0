//! Images sent inline, as vLLM sees them (docs/design.md §2 "images"): the picker must key an
//! image's blocks with the identifier the engine gives it and expand its placeholder to the
//! engine's token count, and the emulator stands in for that engine, so both use this one
//! implementation.
//!
//! - [`data_url_payload`]: the base64 payload of a `data:<type>;base64,<payload>` URL.
//! - [`decode_base64`]: that payload's bytes, decoded as strictly as vLLM does, bounded.
//! - [`image_size`]: width and height as Pillow (vLLM's loader) reports them, from the header of
//!   a PNG (IHDR), JPEG (SOF), WebP (VP8, VP8L, VP8X), GIF (screen and first frame) or BMP (info
//!   header), without decoding pixels; anything else, or a header Pillow would refuse, is `None`.
//!   vLLM hashes the original bytes whatever the format, so the size is all a format changes.
//! - [`content_identifier`]: vLLM's multimodal hash of an image it loaded from bytes (BLAKE3 over
//!   a framed serialization of the model id and the image's original bytes; 64 hex digits).
//! - [`inline_image`]: the size and identifier of a data URL's image in one pass, decoded a
//!   piece at a time and hashed as it comes (what the picker calls per request: the decoded
//!   image is never held whole, so a request's images cost no allocation of their size).
//! - [`inline_image_size`]: the size alone, from as much of the payload as holds the header
//!   (what the picker calls for an image it has not read before; the identifier is read later).
//! - [`payload_key`]: a key to cache [`inline_image`]'s answer by.
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

/// (width, height) in pixels as Pillow reports an image's `size` when vLLM opens it, read from
/// the header of a PNG (IHDR), JPEG (first start-of-frame), WebP (VP8, VP8L or VP8X chunk), GIF
/// (logical screen and first image descriptor) or BMP (info header); `None` for another format,
/// a truncated or malformed header, a zero dimension, or a header Pillow refuses to open (see
/// each format's reader). Pixels are never decoded; reads stop at the header, except that a GIF
/// is walked to its first image descriptor, linear in the input.
pub fn image_size(bytes: &[u8]) -> Option<(u32, u32)> {
    header_size(bytes, bytes.len())
}

/// [`image_size`] of an image of `total_len` bytes from its first bytes `head` (`head.len()` ≤
/// `total_len`): a `Some` here is what [`image_size`] of the whole image gives, since every read
/// is at a fixed place within `head` and only the WebP reader looks at the length, which is
/// `total_len`; `None` when the header reaches past `head` (or is refused).
fn header_size(bytes: &[u8], total_len: usize) -> Option<(u32, u32)> {
    const PNG: &[u8] = b"\x89PNG\r\n\x1a\n";
    let size = if bytes.starts_with(PNG) {
        // Signature, then the IHDR chunk: length 13, type, width and height big-endian.
        if bytes.get(12..16)? != b"IHDR" {
            return None;
        }
        (be32(bytes, 16)?, be32(bytes, 20)?)
    } else if bytes.starts_with(&[0xFF, 0xD8]) {
        jpeg_size(bytes)?
    } else if bytes.starts_with(b"RIFF") && bytes.get(8..12)? == b"WEBP" {
        webp_size(bytes, total_len)?
    } else if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
        gif_size(bytes)?
    } else if bytes.starts_with(b"BM") {
        bmp_size(bytes)?
    } else {
        return None;
    };
    (size.0 > 0 && size.1 > 0).then_some(size)
}

fn be32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

fn be16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(b.get(at..at.checked_add(2)?)?.try_into().ok()?))
}

fn le32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

fn le24(b: &[u8], at: usize) -> Option<u32> {
    let x = b.get(at..at.checked_add(3)?)?;
    Some(u32::from(x[0]) | u32::from(x[1]) << 8 | u32::from(x[2]) << 16)
}

fn le16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at.checked_add(2)?)?.try_into().ok()?))
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

/// WebP (RFC 9649): `RIFF`, the RIFF size (little-endian, counting from byte 8), `WEBP`, then the
/// first chunk's FourCC, size and payload. Pillow opens WebP through libwebp's demuxer, whose
/// canvas is its `size`, and which refuses a file shorter than its RIFF size (trailing bytes are
/// ignored) and these first chunks:
/// - `VP8 ` (lossy): a 3-byte frame tag (bit 0 clear: key frame; bits 1–3: profile ≤ 3; bit 4:
///   shown; bits 5–23: first partition size, under the chunk size), the start code 9D 01 2A,
///   then width and height as 16-bit little-endian words whose top 2 bits are a scale (ignored);
/// - `VP8L` (lossless): the signature 0x2F, then a 32-bit little-endian word of width − 1 (14
///   bits), height − 1 (14 bits), an alpha hint (1 bit) and a version (3 bits, must be 0);
/// - `VP8X` (extended, animated or not): flags and 3 reserved bytes, then the canvas width − 1
///   and height − 1 as 24-bit little-endian numbers, their product under 2³².
///
/// An extended file's frames are not checked against its canvas (libwebp refuses a frame
/// outside it, when the picker would still count the canvas).
fn webp_size(b: &[u8], total_len: usize) -> Option<(u32, u32)> {
    let riff = usize::try_from(le32(b, 4)?).ok()?;
    let chunk = usize::try_from(le32(b, 16)?).ok()?;
    // The RIFF payload ("WEBP", the chunk header, the chunk) must all be there.
    if riff.checked_add(8)? > total_len || chunk.checked_add(12)? > riff {
        return None;
    }
    // The chunk's first bytes (all of it when `b` is the whole file): the fields read below lie
    // within both it and the chunk.
    let data = b.get(20..(20 + chunk).min(b.len()))?;
    match b.get(12..16)? {
        b"VP8 " => {
            let tag = le24(data, 0)?;
            let key_frame = tag & 1 == 0;
            let profile = (tag >> 1) & 7;
            let shown = (tag >> 4) & 1 == 1;
            let partition = usize::try_from(tag >> 5).ok()?;
            if !key_frame || profile > 3 || !shown || partition >= chunk || data.get(3..6)? != [0x9D, 0x01, 0x2A] {
                return None;
            }
            Some((u32::from(le16(data, 6)? & 0x3FFF), u32::from(le16(data, 8)? & 0x3FFF)))
        }
        b"VP8L" => {
            let bits = le32(data, 1)?;
            if *data.first()? != 0x2F || bits >> 29 != 0 {
                return None;
            }
            Some(((bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1))
        }
        b"VP8X" => {
            let (width, height) = (le24(data, 4)? + 1, le24(data, 7)? + 1);
            (u64::from(width) * u64::from(height) < 1 << 32).then_some((width, height))
        }
        _ => None,
    }
}

/// One GIF data sub-block read as Pillow reads it: a length byte, then up to that many bytes
/// (fewer at the end of the input). `None` for a zero length or no length byte; `at` advances
/// past what was read.
fn gif_sub_block<'a>(b: &'a [u8], at: &mut usize) -> Option<&'a [u8]> {
    let len = usize::from(*b.get(*at)?);
    *at += 1;
    if len == 0 {
        return None;
    }
    let start = (*at).min(b.len());
    *at = at.saturating_add(len);
    Some(&b[start..(*at).min(b.len())])
}

/// Sub-blocks until an empty one (zero length, end of input, or cut short to nothing).
fn gif_skip_sub_blocks(b: &[u8], at: &mut usize) {
    while gif_sub_block(b, at).is_some_and(|s| !s.is_empty()) {}
}

/// GIF87a/GIF89a: a 13-byte screen descriptor (signature, logical screen width and height as
/// 16-bit little-endian numbers, flags, background, aspect), the global color table when flagged
/// (3 · 2^(n+1) bytes), then blocks. Pillow's `size` is the logical screen grown to cover the
/// first frame: it walks extensions (0x21, label, sub-blocks) and skips stray bytes up to the
/// first image descriptor (0x2C: left, top, width, height, flags, the local color table when
/// flagged, then the LZW code size byte), and refuses the file when the input or a trailer
/// (0x3B) comes first, or when a graphic control extension is shorter than its fields.
fn gif_size(b: &[u8]) -> Option<(u32, u32)> {
    let screen = (u32::from(le16(b, 6)?), u32::from(le16(b, 8)?));
    let flags = *b.get(..13)?.get(10)?;
    let table = |flags: u8| if flags & 0x80 != 0 { 3usize << ((flags & 7) + 1) } else { 0 };
    let mut at = 13 + table(flags);
    loop {
        match *b.get(at)? {
            0x3B => return None,
            0x21 => {
                let label = *b.get(at + 1)?;
                at += 2;
                let first = gif_sub_block(b, &mut at);
                match (label, first) {
                    // Graphic control: flags, delay (2 bytes), and the transparent index if flagged.
                    (0xF9, Some(block)) if block.len() < 3 || (block[0] & 1 == 1 && block.len() < 4) => return None,
                    // A comment ends at its first empty sub-block.
                    (0xFE, first) => {
                        if first.is_some_and(|s| !s.is_empty()) {
                            gif_skip_sub_blocks(b, &mut at);
                        }
                        continue;
                    }
                    // Pillow reads the looping sub-block of a NETSCAPE2.0 extension before the rest.
                    (0xFF, Some(block)) if block.starts_with(b"NETSCAPE2.0") => {
                        gif_sub_block(b, &mut at);
                    }
                    _ => {}
                }
                // Then sub-blocks up to an empty one, read after the first whatever it was.
                gif_skip_sub_blocks(b, &mut at);
            }
            0x2C => {
                let (left, top) = (u32::from(le16(b, at + 1)?), u32::from(le16(b, at + 3)?));
                let (width, height) = (u32::from(le16(b, at + 5)?), u32::from(le16(b, at + 7)?));
                let flags = *b.get(at + 9)?;
                b.get(at + 10 + table(flags))?;
                return Some((screen.0.max(left + width), screen.1.max(top + height)));
            }
            _ => at += 1,
        }
    }
}

/// BMP: `BM`, a 14-byte file header, then an info header whose first 32-bit little-endian word
/// is its size, read whole. Pillow opens these sizes only:
/// - 12 (BITMAPCOREHEADER): width and height as unsigned 16-bit numbers, bits per pixel at 24,
///   no compression;
/// - 40, 52, 56, 64, 108, 124 (BITMAPINFOHEADER to BITMAPV5HEADER): width as an unsigned 32-bit
///   number at 18, height at 22 (negative for a top-down image: Pillow takes 2³² − height when its
///   top byte is 0xFF, the raw unsigned value otherwise), bits per pixel at 28, compression at
///   30, palette colors at 46.
///
/// Refused as Pillow refuses them: bits per pixel other than 1, 4, 8, 16, 24, 32; compression
/// other than none, RLE8, RLE4 or bit fields (bit fields only at 16, 24 or 32 bits with one of
/// the masks at 54, 58, 62 and, from 56-byte headers, 66 that Pillow knows); a palette over
/// 65,536 colors.
fn bmp_size(b: &[u8]) -> Option<(u32, u32)> {
    let header = le32(b, 14)?;
    let (width, height, bits, compression, colors) = match header {
        12 => (u32::from(le16(b, 18)?), u32::from(le16(b, 20)?), le16(b, 24)?, 0, 0),
        40 | 52 | 56 | 64 | 108 | 124 => {
            let raw = le32(b, 22)?;
            let height = if raw >> 24 == 0xFF { raw.wrapping_neg() } else { raw };
            (le32(b, 18)?, height, le16(b, 28)?, le32(b, 30)?, le32(b, 46)?)
        }
        _ => return None,
    };
    // Pillow reads the whole info header (at most 124 bytes here) before anything else.
    b.get(..14 + usize::try_from(header).ok()?)?;
    if !matches!(bits, 1 | 4 | 8 | 16 | 24 | 32) {
        return None;
    }
    let palette = if colors == 0 { 1u64 << bits } else { u64::from(colors) };
    if bits <= 8 && palette > 65_536 {
        return None;
    }
    match compression {
        0..=2 => {}
        3 => {
            let alpha = if header >= 56 { le32(b, 66)? } else { 0 };
            let masks = (le32(b, 54)?, le32(b, 58)?, le32(b, 62)?);
            const KNOWN_32: [(u32, u32, u32, u32); 8] = [
                (0xFF_0000, 0xFF00, 0xFF, 0),
                (0xFF00_0000, 0xFF_0000, 0xFF00, 0),
                (0xFF00_0000, 0xFF00, 0xFF, 0),
                (0xFF00_0000, 0xFF_0000, 0xFF00, 0xFF),
                (0xFF, 0xFF00, 0xFF_0000, 0xFF00_0000),
                (0xFF_0000, 0xFF00, 0xFF, 0xFF00_0000),
                (0xFF00_0000, 0xFF00, 0xFF, 0xFF_0000),
                (0, 0, 0, 0),
            ];
            let known = match bits {
                32 => KNOWN_32.contains(&(masks.0, masks.1, masks.2, alpha)),
                24 => masks == (0xFF_0000, 0xFF00, 0xFF),
                16 => masks == (0xF800, 0x7E0, 0x1F) || masks == (0x7C00, 0x3E0, 0x1F),
                _ => false,
            };
            if !known {
                return None;
            }
        }
        _ => return None,
    }
    Some((width, height))
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
    let mut h = identifier_start(image.len());
    h.update(image);
    identifier_end(h, model_id)
}

/// Bytes of [`content_identifier`]'s hash input before the image's: two framed "image" keys
/// with their tags (2 · (8 + 5 + 1)) and the image's length (8).
const IDENTIFIER_PREFIX_BYTES: usize = 36;

/// The hash input of [`content_identifier`] up to the image's bytes (whose length comes first).
fn identifier_start(image_len: usize) -> blake3::Hasher {
    let mut h = blake3::Hasher::new();
    framed(&mut h, b"image");
    h.update(&[TAG_LEAF]);
    framed(&mut h, b"image");
    h.update(&[TAG_LEAF]);
    h.update(&(image_len as u64).to_le_bytes());
    h
}

/// The rest of [`content_identifier`]'s input after the image's bytes, and the digest.
fn identifier_end(mut h: blake3::Hasher, model_id: &str) -> String {
    framed(&mut h, b"model_id");
    h.update(&[TAG_LEAF]);
    framed(&mut h, model_id.as_bytes());
    h.finalize().to_hex().to_string()
}

/// A key for caching what [`inline_image`] reads from `payload`: BLAKE3 of the payload's text, so
/// two payloads with the same key are, but for a BLAKE3 collision, the same payload. Linear in
/// the payload, ≈ 3× cheaper than [`inline_image`] with a model id (no base64 decode, no second
/// pass).
pub fn payload_key(payload: &str) -> [u8; 32] {
    *blake3::hash(payload.as_bytes()).as_bytes()
}

/// What [`inline_image`] reads from a data URL's payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InlineImage {
    /// (width, height) in pixels, as [`image_size`] reads it.
    pub size: (u32, u32),
    /// vLLM's identifier ([`content_identifier`]) when a model id was given.
    pub identifier: Option<String>,
}

/// Decoded bytes per step of [`inline_image`]: a multiple of 3 (4/3 as many base64 characters)
/// and of BLAKE3's 16 KiB batches, small enough to stay in the core's cache between decoding and
/// hashing.
const INLINE_CHUNK_BYTES: usize = 48 * 1024;

/// The size and, with `model_id`, vLLM's identifier of the image a base64 `payload` (see
/// [`data_url_payload`]) encodes, read in one pass without holding the decoded image: the
/// payload is decoded [`INLINE_CHUNK_BYTES`] at a time into one buffer, each piece hashed as it
/// comes, and the size read from the first piece's header (the whole image is kept only for a
/// header that reaches past it, e.g. a WebP, whose reader checks the file's length).
///
/// The same answer as [`decode_base64`] then [`image_size`] and [`content_identifier`]: `None`
/// when the payload is not strict base64, would decode to more than `max_bytes` (checked from
/// its length before decoding), or holds no image [`image_size`] reads. Work: one decode and,
/// with `model_id`, one BLAKE3 pass, linear in the payload; memory: one chunk, plus the image
/// in the fallback above.
pub fn inline_image(payload: &str, model_id: Option<&str>, max_bytes: usize) -> Option<InlineImage> {
    inline_image_in_chunks(payload, model_id, max_bytes, INLINE_CHUNK_BYTES)
}

/// The next piece of base64 `rest` that decodes to at most `decoded_bytes` (whole groups of
/// 4 characters), and what follows it; `None` when the piece ends with padding but is not the
/// last: padding ends the payload, and decoding it whole would refuse it there.
fn next_piece(rest: &[u8], decoded_bytes: usize) -> Option<(&[u8], &[u8])> {
    let (piece, after) = rest.split_at((decoded_bytes / 3 * 4).min(rest.len()));
    (after.is_empty() || piece.last() != Some(&b'=')).then_some((piece, after))
}

/// Bytes a padded base64 payload decodes to, known before decoding: padding is required, so a
/// canonical payload is whole 4-character groups, the last with at most two '='. `None` for an
/// empty payload, one that is not whole groups, or one that would decode to more than
/// `max_bytes`.
fn padded_len(input: &[u8], max_bytes: usize) -> Option<usize> {
    if input.is_empty() || !input.len().is_multiple_of(4) {
        return None;
    }
    let padding = input.iter().rev().take(2).take_while(|&&c| c == b'=').count();
    let len = input.len() / 4 * 3 - padding;
    (len <= max_bytes).then_some(len)
}

fn inline_image_in_chunks(
    payload: &str,
    model_id: Option<&str>,
    max_bytes: usize,
    chunk_bytes: usize,
) -> Option<InlineImage> {
    let input = payload.as_bytes();
    let len = padded_len(input, max_bytes)?;
    let mut hasher = model_id.map(|_| identifier_start(len));
    // The first piece is shorter by the hash input before the image, so that every later piece
    // starts the hasher on a boundary of BLAKE3's 1 KiB chunks (and of its 16-chunk batches
    // with INLINE_CHUNK_BYTES): hashing then runs at the speed of one whole-buffer call.
    let first = if chunk_bytes > IDENTIFIER_PREFIX_BYTES { chunk_bytes - IDENTIFIER_PREFIX_BYTES } else { chunk_bytes };
    let mut buf = vec![0u8; chunk_bytes];
    let mut size = None;
    let mut whole = Vec::new();
    let mut rest = input;
    let mut piece_bytes = first;
    let mut at_start = true;
    while !rest.is_empty() {
        let (piece, after) = next_piece(rest, piece_bytes)?;
        rest = after;
        let n = STRICT.decode_slice(piece, &mut buf).ok()?;
        let bytes = &buf[..n];
        if at_start {
            size = image_size(bytes);
        }
        if size.is_none() {
            whole.extend_from_slice(bytes);
        }
        if let Some(h) = hasher.as_mut() {
            h.update(bytes);
        }
        at_start = false;
        piece_bytes = chunk_bytes;
    }
    let size = match size {
        Some(s) => s,
        None => image_size(&whole)?,
    };
    let identifier = hasher.zip(model_id).map(|(h, model)| identifier_end(h, model));
    Some(InlineImage { size, identifier })
}

/// Decoded bytes of [`inline_image_size`]'s first piece; each later piece doubles what is decoded.
const HEADER_FIRST_BYTES: usize = 3 * 1024;

/// The size of the image a base64 `payload` encodes, read from its header only: the payload is
/// decoded from its start in pieces ([`HEADER_FIRST_BYTES`], then doubling what is held) until
/// the header gives the size, so a PNG costs one small piece and a JPEG whose frame header comes
/// after large APPn segments (EXIF, ICC) a few; the image's bytes past its header are neither
/// decoded nor hashed. A `Some` is what [`inline_image`] gives for a payload whose every piece is
/// strict base64 (only the pieces decoded are checked here); `None` as there for a payload that
/// is not padded whole groups, would decode to more than `max_bytes`, is not strict base64 in
/// what was decoded, or holds no header [`image_size`] reads. Work: at most one decode of the
/// payload (a header that is not found), memory at most the decoded image in that case.
pub fn inline_image_size(payload: &str, max_bytes: usize) -> Option<(u32, u32)> {
    let input = payload.as_bytes();
    let len = padded_len(input, max_bytes)?;
    let mut head = Vec::new();
    let mut rest = input;
    let mut piece_bytes = HEADER_FIRST_BYTES;
    while !rest.is_empty() {
        let (piece, after) = next_piece(rest, piece_bytes)?;
        rest = after;
        let at = head.len();
        head.resize(at + piece.len() / 4 * 3, 0);
        let n = STRICT.decode_slice(piece, &mut head[at..]).ok()?;
        head.truncate(at + n);
        if let Some(size) = header_size(&head, len) {
            return Some(size);
        }
        piece_bytes = head.len();
    }
    None
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
        assert_eq!(image_size(b"GIF89a\x01\0\x01\0"), None, "a GIF cut short");
        assert_eq!(image_size(b"II*\0\x08\0\0\0\0\0\0\0\0\0\0\0"), None, "other formats (TIFF)");
        // A segment length that points backwards or nowhere ends the walk.
        assert_eq!(image_size(&[0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x01]), None);
        assert_eq!(image_size(&[0xFF, 0xD8, 0xFF, 0xE0, 0xFF, 0xFF]), None);
    }

    /// A WebP file: the RIFF header around one chunk, then `after` (more chunks), RIFF size exact.
    fn webp(fourcc: &[u8; 4], payload: &[u8], after: &[u8]) -> Vec<u8> {
        let riff = 4 + 8 + payload.len() + after.len();
        let mut b = b"RIFF".to_vec();
        b.extend_from_slice(&(riff as u32).to_le_bytes());
        b.extend_from_slice(b"WEBP");
        b.extend_from_slice(fourcc);
        b.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        b.extend_from_slice(payload);
        b.extend_from_slice(after);
        b
    }

    /// A lossy key frame: frame tag (key frame, profile 0, shown, first partition of 1 byte), start
    /// code, the raw 16-bit width and height fields (scale in the top 2 bits), a little payload.
    fn vp8(width_field: u16, height_field: u16) -> Vec<u8> {
        vp8_tagged(0x10 | 1 << 5, width_field, height_field)
    }

    fn vp8_tagged(tag: u32, width_field: u16, height_field: u16) -> Vec<u8> {
        let mut p = tag.to_le_bytes()[..3].to_vec();
        p.extend_from_slice(&[0x9D, 0x01, 0x2A]);
        p.extend_from_slice(&width_field.to_le_bytes());
        p.extend_from_slice(&height_field.to_le_bytes());
        p.extend_from_slice(&[0; 6]);
        webp(b"VP8 ", &p, &[])
    }

    /// A lossless header: signature, then width − 1, height − 1 (14 bits each), alpha, version.
    fn vp8l(width: u32, height: u32, version: u32) -> Vec<u8> {
        let bits = (width - 1) | (height - 1) << 14 | 1 << 28 | version << 29;
        let mut p = vec![0x2F];
        p.extend_from_slice(&bits.to_le_bytes());
        p.push(0);
        webp(b"VP8L", &p, &[])
    }

    /// An extended (animated) header: flags, reserved, canvas width − 1 and height − 1 (24 bits
    /// each), then an ANIM chunk.
    fn vp8x(width: u32, height: u32) -> Vec<u8> {
        let mut p = vec![0x02, 0, 0, 0];
        p.extend_from_slice(&(width - 1).to_le_bytes()[..3]);
        p.extend_from_slice(&(height - 1).to_le_bytes()[..3]);
        webp(b"VP8X", &p, b"ANIM\x06\0\0\0\0\0\0\0\0\0")
    }

    #[test]
    fn sizes_from_webp_headers() {
        assert_eq!(image_size(&vp8(640, 480)), Some((640, 480)));
        // The scale bits are not part of the size; 14 bits is the largest.
        assert_eq!(image_size(&vp8(0xC000 | 640, 0x4000 | 480)), Some((640, 480)));
        assert_eq!(image_size(&vp8(0x3FFF, 0xFFFF)), Some((16_383, 16_383)));
        assert_eq!(image_size(&vp8(0xC000, 480)), None, "zero width under the scale bits");
        // Frame tags libwebp refuses: not a key frame, profile 4, not shown, a first partition
        // as long as the chunk; a wrong start code.
        let chunk = vp8(640, 480).len() as u32 - 20;
        for tag in [0x31, 0x10 | 4 << 1 | 1 << 5, 1 << 5, 0x10 | chunk << 5] {
            assert_eq!(image_size(&vp8_tagged(tag, 640, 480)), None, "tag {tag:#x}");
        }
        assert_eq!(image_size(&vp8_tagged(0x10 | (chunk - 1) << 5, 640, 480)), Some((640, 480)));
        let mut code = vp8(640, 480);
        code[24] = 0x2B;
        assert_eq!(image_size(&code), None);

        assert_eq!(image_size(&vp8l(300, 200, 0)), Some((300, 200)));
        assert_eq!(image_size(&vp8l(1, 1, 0)), Some((1, 1)));
        assert_eq!(image_size(&vp8l(16_384, 16_384, 0)), Some((16_384, 16_384)), "14 bits of w − 1");
        assert_eq!(image_size(&vp8l(16_384, 1, 0)), Some((16_384, 1)), "height − 1 = 0 is 1");
        assert_eq!(image_size(&vp8l(300, 200, 1)), None, "version 1");
        let mut signature = vp8l(300, 200, 0);
        signature[20] = 0x2E;
        assert_eq!(image_size(&signature), None);

        // The canvas, whatever the frames; 24 bits of w − 1, area under 2³².
        assert_eq!(image_size(&vp8x(100, 80)), Some((100, 80)));
        assert_eq!(image_size(&vp8x(1 << 24, 1)), Some((1 << 24, 1)));
        assert_eq!(image_size(&vp8x(65_536, 65_535)), Some((65_536, 65_535)));
        assert_eq!(image_size(&vp8x(1 << 24, 256)), None, "area 2³²");

        // Container: trailing bytes are ignored, a short file or a chunk past the RIFF size is
        // refused, and so is any other first chunk.
        let mut trailing = vp8l(300, 200, 0);
        trailing.extend_from_slice(&[0; 9]);
        assert_eq!(image_size(&trailing), Some((300, 200)));
        for full in [vp8(640, 480), vp8l(300, 200, 0), vp8x(100, 80)] {
            for cut in 0..full.len() {
                assert_eq!(image_size(&full[..cut]), None, "cut at {cut} of {:?}", &full[12..16]);
            }
            let mut short_riff = full.clone();
            short_riff[4] = short_riff[4].wrapping_sub(if &full[12..16] == b"VP8X" { 15 } else { 1 });
            assert_eq!(image_size(&short_riff), None, "chunk past the RIFF size");
            let mut other = full.clone();
            other[15] = b'Z';
            assert_eq!(image_size(&other), None);
        }
        assert_eq!(image_size(&webp(b"VP8X", &[0; 9], &[])), None, "VP8X chunk too short");
    }

    /// A GIF: screen descriptor (optionally a global color table of 2^(n+1) colors), `blocks`
    /// verbatim, then an image descriptor at (left, top) of width × height with its LZW code size.
    fn gif(screen: (u16, u16), table: Option<u8>, blocks: &[u8], frame: [u16; 4]) -> Vec<u8> {
        let mut b = b"GIF89a".to_vec();
        b.extend_from_slice(&screen.0.to_le_bytes());
        b.extend_from_slice(&screen.1.to_le_bytes());
        b.extend_from_slice(&[table.map_or(0, |n| 0x80 | n), 0, 0]);
        b.resize(b.len() + table.map_or(0, |n| 3 << (n + 1)), 0x55);
        b.extend_from_slice(blocks);
        b.push(0x2C);
        for field in frame {
            b.extend_from_slice(&field.to_le_bytes());
        }
        b.extend_from_slice(&[0, 8, 2, 0x4C, 0x01, 0, 0x3B]);
        b
    }

    /// Graphic control (4 bytes, transparent), NETSCAPE2.0 looping, a two-sub-block comment.
    const GIF_EXTENSIONS: &[u8] =
        b"!\xF9\x04\x01\x0A\x00\x05\x00!\xFF\x0BNETSCAPE2.0\x03\x01\x00\x00\x00!\xFE\x02hi\x01!\x00";

    #[test]
    fn sizes_from_gif_headers() {
        assert_eq!(image_size(&gif((150, 100), None, &[], [0, 0, 150, 100])), Some((150, 100)));
        let mut old = gif((150, 100), Some(7), GIF_EXTENSIONS, [0, 0, 150, 100]);
        old[4] = b'7';
        assert_eq!(image_size(&old), Some((150, 100)), "GIF87a, 256-color table, extensions");
        // The first frame grows the logical screen (Pillow's size), a smaller one does not.
        assert_eq!(image_size(&gif((150, 100), Some(0), &[], [100, 90, 60, 20])), Some((160, 110)));
        assert_eq!(image_size(&gif((0, 0), None, &[], [0, 0, 30, 40])), Some((30, 40)));
        assert_eq!(image_size(&gif((150, 100), None, &[], [10, 10, 5, 5])), Some((150, 100)));
        assert_eq!(image_size(&gif((u16::MAX, 1), None, &[], [u16::MAX, 0, u16::MAX, 1])), Some((131_070, 1)));
        assert_eq!(image_size(&gif((0, 100), None, &[], [0, 0, 0, 0])), None, "zero width");
        // Pillow skips a stray byte, but stops at a trailer before any frame.
        assert_eq!(image_size(&gif((8, 8), None, b"\x00\x42", [0, 0, 8, 8])), Some((8, 8)));
        assert_eq!(image_size(&gif((8, 8), None, b";", [0, 0, 8, 8])), None);
        // A graphic control extension shorter than its fields is refused.
        assert_eq!(image_size(&gif((8, 8), None, b"!\xF9\x02\x00\x00\x00", [0, 0, 8, 8])), None);
        assert_eq!(image_size(&gif((8, 8), None, b"!\xF9\x03\x01\x00\x00\x00", [0, 0, 8, 8])), None);
        assert_eq!(image_size(&gif((8, 8), None, b"!\xF9\x03\x00\x00\x00\x00", [0, 0, 8, 8])), Some((8, 8)));
        // An extension of no sub-blocks: Pillow reads one more length byte after its terminator
        // (here 0x2C, so the descriptor is skipped as data and no frame follows).
        assert_eq!(image_size(&gif((8, 8), None, b"!\x01\x00", [0, 0, 8, 8])), None);
        assert_eq!(image_size(&gif((8, 8), None, b"!\x01\x00\x00", [0, 0, 8, 8])), Some((8, 8)));
        // Every cut before the LZW code size byte is refused.
        let full = gif((150, 100), Some(1), GIF_EXTENSIONS, [1, 2, 150, 100]);
        let code_size = full.len() - 6;
        for cut in 0..=code_size {
            assert_eq!(image_size(&full[..cut]), None, "cut at {cut}");
        }
        assert_eq!(image_size(&full[..code_size + 1]), Some((151, 102)));
        // A local color table must be there in full.
        let mut local = gif((8, 8), None, &[], [0, 0, 8, 8]);
        let flags = local.len() - 7;
        local[flags] = 0x81;
        assert_eq!(image_size(&local), None, "12-byte table and the code size byte, 6 bytes left");
        local.extend_from_slice(&[0; 6]);
        assert_eq!(image_size(&local), None, "no code size byte");
        local.push(8);
        assert_eq!(image_size(&local), Some((8, 8)));
    }

    /// A BMP with an info header of `size` bytes (40 and up): width, raw height, bits per pixel,
    /// compression, palette colors, and the bit-field masks at 54 (the three after a 40-byte
    /// header kept only with bit fields), the file cut at the header's end.
    fn bmp(size: u32, width: u32, height: u32, bits: u16, compression: u32, colors: u32, masks: [u32; 4]) -> Vec<u8> {
        let mut b = b"BM\0\0\0\0\0\0\0\0\0\0\0\0".to_vec();
        b.extend_from_slice(&size.to_le_bytes());
        b.extend_from_slice(&width.to_le_bytes());
        b.extend_from_slice(&height.to_le_bytes());
        b.extend_from_slice(&1u16.to_le_bytes());
        b.extend_from_slice(&bits.to_le_bytes());
        b.extend_from_slice(&compression.to_le_bytes());
        b.extend_from_slice(&[0; 12]);
        b.extend_from_slice(&colors.to_le_bytes());
        b.extend_from_slice(&[0; 4]);
        for mask in masks {
            b.extend_from_slice(&mask.to_le_bytes());
        }
        // The masks lie past a 40-byte header; without bit fields nothing past the header is read.
        let end = 14 + size as usize;
        b.resize(if compression == 3 { end.max(66) } else { end }, 0);
        b
    }

    fn bmp_core(width: u16, height: u16, bits: u16) -> Vec<u8> {
        let mut b = b"BM\0\0\0\0\0\0\0\0\0\0\0\0\x0c\0\0\0".to_vec();
        for field in [width, height, 1, bits] {
            b.extend_from_slice(&field.to_le_bytes());
        }
        b
    }

    #[test]
    fn sizes_from_bmp_headers() {
        let plain = |height: u32| bmp(40, 640, height, 24, 0, 0, [0; 4]);
        assert_eq!(image_size(&plain(480)), Some((640, 480)));
        // A negative height is a top-down image of the same size.
        assert_eq!(image_size(&plain((-480i32) as u32)), Some((640, 480)));
        assert_eq!(image_size(&plain(u32::MAX)), Some((640, 1)));
        // Pillow negates only heights whose top byte is 0xFF: a lower one reads as a huge height.
        assert_eq!(image_size(&plain(0x8000_0000)), Some((640, 0x8000_0000)));
        assert_eq!(image_size(&plain(0)), None);
        assert_eq!(image_size(&bmp(40, 0, 480, 24, 0, 0, [0; 4])), None);
        for size in [52, 56, 64, 108, 124] {
            assert_eq!(image_size(&bmp(size, 90, 60, 32, 0, 0, [0; 4])), Some((90, 60)), "{size}");
        }
        assert_eq!(image_size(&bmp_core(90, 60, 8)), Some((90, 60)));
        assert_eq!(image_size(&bmp_core(90, 60, 2)), None, "2 bits per pixel");
        assert_eq!(image_size(&bmp_core(0, 60, 8)), None);
        for (size, bits, compression, colors) in
            [(20, 24, 0, 0), (40, 2, 0, 0), (40, 64, 0, 0), (40, 24, 4, 0), (40, 8, 6, 0), (40, 8, 0, 65_537)]
        {
            assert_eq!(
                image_size(&bmp(size, 9, 6, bits, compression, colors, [0; 4])),
                None,
                "{size} {bits} {compression} {colors}"
            );
        }
        assert_eq!(image_size(&bmp(40, 9, 6, 8, 0, 65_536, [0; 4])), Some((9, 6)));
        assert_eq!(image_size(&bmp(40, 9, 6, 4, 2, 0, [0; 4])), Some((9, 6)), "RLE4");
        // Bit fields: only the layouts Pillow knows; the alpha mask counts from 56-byte headers.
        let fields = |size, bits, masks| image_size(&bmp(size, 9, 6, bits, 3, 0, masks));
        assert_eq!(fields(40, 16, [0xF800, 0x7E0, 0x1F, 0]), Some((9, 6)));
        assert_eq!(fields(40, 24, [0xFF_0000, 0xFF00, 0xFF, 0]), Some((9, 6)));
        assert_eq!(fields(40, 24, [0xFF, 0xFF00, 0xFF_0000, 0]), None);
        assert_eq!(fields(124, 32, [0xFF, 0xFF00, 0xFF_0000, 0xFF00_0000]), Some((9, 6)));
        assert_eq!(fields(52, 32, [0xFF, 0xFF00, 0xFF_0000, 0xFF00_0000]), None, "alpha not read: unknown");
        assert_eq!(fields(124, 8, [0; 4]), None);
        // Every cut inside the info header is refused (a 40-byte header with bit fields needs
        // its three masks after it).
        for full in [plain(480), bmp(124, 9, 6, 24, 0, 0, [0; 4]), bmp_core(90, 60, 8)] {
            for cut in 0..full.len() {
                assert_eq!(image_size(&full[..cut]), None, "cut at {cut} of {}", full.len());
            }
        }
        let masked = bmp(40, 9, 6, 16, 3, 0, [0x7C00, 0x3E0, 0x1F, 0]);
        assert_eq!(image_size(&masked[..65]), None);
        assert_eq!(image_size(&masked[..66]), Some((9, 6)));
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
        /// Hostile headers: any bytes after the signature of each format read are read without a
        /// panic, and a size comes back only with both sides non-zero. WebP gets a RIFF size and
        /// a chunk size that fit the bytes about half the time, so the chunk readers are reached.
        #[test]
        fn any_header_is_read_without_panic(
            tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..96),
            format in 0usize..8,
            sizes_fit: bool,
        ) {
            const SIGNATURES: [&[u8]; 8] =
                [b"\x89PNG\r\n\x1a\n", &[0xFF, 0xD8], b"VP8 ", b"VP8L", b"VP8X", b"GIF87a", b"GIF89a", b"BM"];
            let signature = SIGNATURES[format];
            let bytes = match <&[u8; 4]>::try_from(signature) {
                Ok(fourcc) if signature.starts_with(b"VP8") => {
                    let mut b = webp(fourcc, &tail, &[]);
                    if !sizes_fit {
                        b[4..8].copy_from_slice(&u32::from(tail.len() as u8).to_le_bytes());
                        b[16..20].copy_from_slice(&10u32.to_le_bytes());
                    }
                    b
                }
                _ => [signature, &tail].concat(),
            };
            if let Some((w, h)) = image_size(&bytes) {
                proptest::prop_assert!(w > 0 && h > 0);
                if format == 2 || format == 3 {
                    proptest::prop_assert!(w <= 16_384 && h <= 16_384, "14-bit fields");
                }
            }
            let text = String::from_utf8_lossy(&tail);
            let _ = decode_base64(&text, 64);
        }

        /// Any payload, valid or not, read in pieces of any size: the answer of decoding it
        /// whole, sizing and hashing it (`read_whole`). Payloads are the base64 of bytes after
        /// an image signature, then spoiled one way or none: padding moved inside, a character
        /// outside the alphabet, a character dropped, the bound just under the size.
        #[test]
        fn inline_image_in_pieces_answers_as_decoding_whole(
            tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400),
            format in 0usize..3,
            spoil in 0usize..6,
            at in proptest::prelude::any::<proptest::sample::Index>(),
            pieces in 1usize..40,
        ) {
            use base64::Engine as _;
            let head: Vec<u8> = match format {
                0 => png(640, 480),
                1 => jpeg(300, 200, 0xC0),
                _ => [b"GIF89a".as_slice(), &[10, 0, 10, 0, 0, 0, 0]].concat(),
            };
            let bytes = [head, tail].concat();
            let mut payload = base64::engine::general_purpose::STANDARD.encode(&bytes);
            let mut max = bytes.len() + 3;
            let i = at.index(payload.len());
            match spoil {
                1 => payload.insert_str(i - i % 4, "AA=="),
                2 => payload.replace_range(i..=i, "-"),
                3 => { payload.remove(i); }
                4 => max = bytes.len() - 1,
                _ => {}
            }
            let want = read_whole(&payload, Some("m"), max);
            proptest::prop_assert_eq!(&inline_image_in_chunks(&payload, Some("m"), max, 3 * pieces), &want);
            proptest::prop_assert_eq!(inline_image(&payload, None, max), want.clone().map(|w| InlineImage { identifier: None, ..w }));
            // Header-only: a size found is the whole read's when that read succeeds (it may
            // find one where the whole read refuses a spoiled tail it never decodes).
            let head_only = inline_image_size(&payload, max);
            if let Some(w) = &want {
                proptest::prop_assert_eq!(head_only, Some(w.size));
            } else if head_only.is_some() {
                proptest::prop_assert!(spoil == 2 || spoil == 3 || spoil == 1, "refused whole, sized by header: {}", spoil);
            }
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

    /// [`inline_image`]'s answer computed the plain way: decode all, size, hash.
    fn read_whole(payload: &str, model_id: Option<&str>, max_bytes: usize) -> Option<InlineImage> {
        let bytes = decode_base64(payload, max_bytes)?;
        let size = image_size(&bytes)?;
        Some(InlineImage { size, identifier: model_id.map(|m| content_identifier(m, &bytes)) })
    }

    /// Real files of every format (tests/fixtures/images), read in pieces from 3 bytes up to
    /// past their length: the first piece's header or, when it is cut there (or, for a WebP,
    /// always), the whole file gives the same size, and the hash is the same.
    #[test]
    fn inline_images_in_pieces_of_any_size() {
        use base64::Engine as _;
        let dir = format!("{}/../tests/fixtures/images", env!("CARGO_MANIFEST_DIR"));
        let mut files = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let bytes = std::fs::read(entry.unwrap().path()).unwrap();
            let payload = base64::engine::general_purpose::STANDARD.encode(&bytes);
            let want = read_whole(&payload, Some("Qwen/Qwen2.5-VL-3B-Instruct"), 1 << 20);
            assert!(want.is_some());
            for chunk in (3..600).step_by(3).chain([3 * 1024, 48 * 1024]) {
                let got = inline_image_in_chunks(&payload, Some("Qwen/Qwen2.5-VL-3B-Instruct"), 1 << 20, chunk);
                assert_eq!(got, want, "{} bytes at a time", chunk);
            }
            assert_eq!(inline_image(&payload, None, 1 << 20).map(|i| i.size), want.map(|w| w.size));
            assert_eq!(inline_image(&payload, None, bytes.len() - 1), None, "over the bound");
            files += 1;
        }
        assert!(files >= 7, "the fixtures: {files}");
    }

    /// Header-only sizing: every fixture gets the size reading it whole gives, from its first
    /// 64 bytes too (a WebP's length check uses the whole image's length), and a large image is
    /// sized from its head: a JPEG whose frame header follows 200 KB of APP segments, and a PNG
    /// whose bytes past the first piece are not base64 (never decoded, so not refused).
    #[test]
    fn inline_images_sized_from_the_header_only() {
        use base64::Engine as _;
        let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        let dir = format!("{}/../tests/fixtures/images", env!("CARGO_MANIFEST_DIR"));
        for entry in std::fs::read_dir(&dir).unwrap() {
            let bytes = std::fs::read(entry.unwrap().path()).unwrap();
            let want = image_size(&bytes);
            assert!(want.is_some());
            assert_eq!(inline_image_size(&b64(&bytes), 1 << 20), want);
            assert_eq!(inline_image_size(&b64(&bytes), bytes.len() - 1), None, "over the bound");
            let head = &bytes[..64.min(bytes.len())];
            if header_size(head, bytes.len()).is_some() {
                assert_eq!(header_size(head, bytes.len()), want);
            }
            if bytes.starts_with(b"RIFF") {
                assert_eq!(header_size(head, bytes.len()), want, "a WebP's header is in its first bytes");
                assert_eq!(header_size(head, bytes.len() - 1), None, "shorter than its RIFF size");
            }
        }
        // A JPEG: SOI, four 50 KB APP1 segments, then the frame header.
        let mut jpeg = vec![0xFF, 0xD8];
        for _ in 0..4 {
            jpeg.extend_from_slice(&[0xFF, 0xE1, 0xC3, 0x50]);
            jpeg.resize(jpeg.len() + 0xC350 - 2, 0x42);
        }
        jpeg.extend_from_slice(&[0xFF, 0xC0, 0x00, 0x11, 0x08, 0x02, 0xD0, 0x05, 0x00, 3]);
        jpeg.resize(jpeg.len() + 300_000, 0);
        let payload = b64(&jpeg);
        assert_eq!(inline_image_size(&payload, 1 << 20), Some((1280, 720)));
        assert_eq!(inline_image(&payload, None, 1 << 20).map(|i| i.size), Some((1280, 720)));
        // A PNG: the header in the first piece, the rest not base64 at all.
        let mut png = png(640, 480);
        png.resize(300_000, 7);
        let mut payload = b64(&png);
        payload.replace_range(8_000..8_004, "!!!!");
        assert_eq!(inline_image_size(&payload, 1 << 20), Some((640, 480)));
        assert_eq!(inline_image(&payload, None, 1 << 20), None, "read whole, refused");
        // Refused as reading whole refuses: not padded groups, foreign bytes, no header.
        assert_eq!(inline_image_size("iVBORw0", 1 << 20), None);
        assert_eq!(inline_image_size(&b64(&[0u8; 10_000]), 1 << 20), None);
        assert_eq!(inline_image_size("!!!!", 1 << 20), None);
        assert_eq!(inline_image_size("", 1 << 20), None);
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
        assert_eq!(identifier_start(image.len()).count(), IDENTIFIER_PREFIX_BYTES as u64, "the prefix's length");
        assert_eq!(id.len(), 64);
        assert!(id.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)));
        assert_ne!(id, content_identifier("Qwen/Qwen2-VL-7B-Instruct", image), "the model is part of it");
        assert_ne!(id, content_identifier("Qwen/Qwen2.5-VL-7B-Instruct", b"\x89PNG other bytes"));
    }
}
