//! Fixture tests: every captured vLLM message decodes to what `expected.json` says.

use super::*;
use rmpv::Value;
use serde_json::{Value as Json, json};

const FOLDERS: [&str; 2] = ["v0.33", "legacy-array"];

fn dir(folder: &str) -> String {
    format!("{}/../tests/fixtures/vllm-kv-events/{folder}", env!("CARGO_MANIFEST_DIR"))
}

fn frames(folder: &str, n: usize) -> Vec<Vec<u8>> {
    ["topic", "seq", "msgpack"]
        .iter()
        .map(|ext| std::fs::read(format!("{}/batch-{n}.{ext}", dir(folder))).expect("fixture frame"))
        .collect()
}

fn expected(folder: &str, file: &str) -> Json {
    let text = std::fs::read_to_string(format!("{}/{file}", dir(folder))).expect("fixture json");
    serde_json::from_str(&text).expect("valid json")
}

fn medium_name(m: &Medium) -> String {
    match m {
        Medium::Gpu => "GPU".into(),
        Medium::Cpu => "CPU".into(),
        Medium::Other(s) => s.clone(),
    }
}

/// Our decoded event in the fixture's generic map form (fields we model).
fn ours(e: &KvEvent) -> Json {
    match e {
        KvEvent::Stored(s) => json!({
            "type": "BlockStored",
            "block_hashes": s.block_hashes.iter().map(|h| h.0).collect::<Vec<_>>(),
            "parent_block_hash": s.parent.map(|h| h.0),
            "token_ids": s.token_ids,
            "block_size": s.block_size,
            "lora_id": s.lora_id,
            "medium": medium_name(&s.medium),
            "lora_name": s.lora_name,
        }),
        KvEvent::Removed { block_hashes, medium } => json!({
            "type": "BlockRemoved",
            "block_hashes": block_hashes.iter().map(|h| h.0).collect::<Vec<_>>(),
            "medium": medium_name(medium),
        }),
        KvEvent::AllCleared => json!({"type": "AllBlocksCleared"}),
        KvEvent::Untrusted(why) => json!({"type": "Untrusted", "why": why}),
    }
}

/// The fixture's event (map or positional array) in the same form.
fn theirs(e: &Json) -> Json {
    let get = |k: &str, pos: usize| -> Json {
        match e {
            Json::Object(m) => m.get(k).cloned().unwrap_or(Json::Null),
            Json::Array(a) => a.get(pos).cloned().unwrap_or(Json::Null),
            _ => Json::Null,
        }
    };
    let kind = get("type", 0);
    match kind.as_str() {
        Some("BlockStored") => json!({
            "type": "BlockStored", "block_hashes": get("block_hashes", 1), "parent_block_hash": get("parent_block_hash", 2),
            "token_ids": get("token_ids", 3), "block_size": get("block_size", 4), "lora_id": get("lora_id", 5),
            "medium": match get("medium", 6) { Json::Null => json!("GPU"), m => m }, "lora_name": get("lora_name", 7),
        }),
        Some("BlockRemoved") => json!({
            "type": "BlockRemoved", "block_hashes": get("block_hashes", 1),
            "medium": match get("medium", 2) { Json::Null => json!("GPU"), m => m },
        }),
        _ => json!({"type": kind}),
    }
}

fn check_message(msg: &KvMessage, want: &Json) {
    assert_eq!(msg.topic, want["topic"].as_str().expect("topic"));
    assert_eq!(msg.seq, want["seq"].as_u64().expect("seq"));
    let payload = &want["payload_generic"];
    assert_eq!(msg.batch.ts, payload[0].as_f64().expect("ts"));
    assert_eq!(msg.batch.dp_rank, payload[2].as_i64());
    let want_events = payload[1].as_array().expect("events");
    assert_eq!(msg.batch.events.len(), want_events.len());
    for (got, want) in msg.batch.events.iter().zip(want_events) {
        assert_eq!(ours(got), theirs(want));
    }
}

#[test]
fn every_fixture_batch_decodes_as_expected() {
    for folder in FOLDERS {
        let want = expected(folder, "expected.json");
        let want = want.as_array().expect("array");
        assert_eq!(want.len(), 5);
        for (n, w) in want.iter().enumerate() {
            let msg = decode_message(&frames(folder, n)).unwrap_or_else(|e| panic!("{folder} batch {n}: {e}"));
            check_message(&msg, w);
        }
    }
}

#[test]
fn extra_keys_keep_salt_and_items_and_drop_the_lora_name() {
    use kvroute_common::ExtraKey;
    for folder in FOLDERS {
        let msg = decode_message(&frames(folder, 3)).expect("decodes");
        let KvEvent::Stored(lora) = &msg.batch.events[0] else { panic!("BlockStored expected") };
        assert_eq!(lora.lora_name.as_deref(), Some("sql-lora"));
        assert_eq!(lora.extra_keys, vec![BlockExtra::Plain], "the LoRA name is in the hash root already");
    }
    let mm = Value::Array(vec![Value::Array(vec![Value::Array(vec![Value::from("3f2a…mmhash"), Value::from(-3)])])]);
    assert_eq!(extra_of(mm, 1, None), vec![BlockExtra::Keys(vec![ExtraKey::Item("3f2a…mmhash".into(), -3)])]);
    let salted = Value::Array(vec![Value::Array(vec![Value::from("sql-lora"), Value::from("salt")]), Value::Nil]);
    assert_eq!(
        extra_of(salted.clone(), 2, Some("sql-lora")),
        vec![BlockExtra::Keys(vec![ExtraKey::Str("salt".into())]), BlockExtra::Plain]
    );
    // A list whose length is not the block count cannot be placed.
    assert_eq!(extra_of(salted, 3, Some("sql-lora")), vec![BlockExtra::Opaque; 3]);
    assert_eq!(extra_of(Value::Nil, 2, None), vec![BlockExtra::Plain; 2]);
    assert_eq!(extra_of(Value::from("sql-lora"), 2, Some("sql-lora")), vec![BlockExtra::Opaque; 2]);
    // Keys of an unknown shape (an integer, a three-element item) make the block opaque.
    let odd = Value::Array(vec![
        Value::Array(vec![Value::from(7)]),
        Value::Array(vec![Value::Array(vec![Value::from("x"), Value::from(1), Value::from(2)])]),
    ]);
    assert_eq!(extra_of(odd, 2, None), vec![BlockExtra::Opaque; 2]);
}

/// `extra_keys` of a BlockStored map of `blocks` blocks with `extra_keys` LAST (after
/// `lora_name`, which it is judged against: map fields may come in any order).
fn extra_of(extra_keys: Value, blocks: u64, lora: Option<&str>) -> Vec<BlockExtra> {
    let ev = Value::Map(vec![
        (Value::from("type"), Value::from("BlockStored")),
        (Value::from("block_hashes"), Value::Array((1..=blocks).map(Value::from).collect())),
        (Value::from("token_ids"), Value::Array((0..blocks * 16).map(Value::from).collect())),
        (Value::from("block_size"), Value::from(16)),
        (Value::from("lora_name"), lora.map_or(Value::Nil, Value::from)),
        (Value::from("extra_keys"), extra_keys),
    ]);
    let batch = Value::Array(vec![Value::F64(0.0), Value::Array(vec![ev])]);
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &batch).expect("encode");
    let b = decode_batch(&buf).expect("decodes");
    let [KvEvent::Stored(s)] = &b.events[..] else { panic!("one BlockStored expected: {b:?}") };
    s.extra_keys.clone()
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

#[test]
fn replay_fixture_frames_decode() {
    for folder in FOLDERS {
        let all = expected(folder, "expected.json");
        let replay = expected(folder, "replay-from-2.json");
        let replies = replay.as_array().expect("array");
        assert_eq!(replies.len(), 4);
        for (i, r) in replies.iter().enumerate() {
            let frames: Vec<Vec<u8>> =
                r["frames"].as_array().expect("frames").iter().map(|f| hex(f.as_str().expect("hex str"))).collect();
            match decode_replay(&frames).expect("replay decodes") {
                ReplayFrame::Batch(msg) => check_message(&msg, &all[i + 2]),
                ReplayFrame::End => assert_eq!(i, 3, "end marker is last"),
            }
        }
    }
}

#[test]
fn older_replay_framing_decodes() {
    for folder in FOLDERS {
        let all = expected(folder, "expected.json");
        for n in 2..5 {
            let f = frames(folder, n);
            let older = vec![Vec::new(), f[1].clone(), f[2].clone()];
            match decode_replay(&older).expect("decodes") {
                ReplayFrame::Batch(msg) => {
                    assert_eq!(msg.topic, "");
                    assert_eq!(msg.seq, n as u64);
                    assert_eq!(msg.batch, decode_message(&f).expect("decodes").batch);
                    assert_eq!(msg.batch.events.len(), all[n]["payload_generic"][1].as_array().map_or(0, Vec::len));
                }
                ReplayFrame::End => panic!("not the end"),
            }
        }
    }
    let end = vec![Vec::new(), (-1i64).to_be_bytes().to_vec(), Vec::new()];
    assert_eq!(decode_replay(&end), Ok(ReplayFrame::End));
}

#[test]
fn batch_as_map_and_byte_hashes() {
    let ev = Value::Map(vec![
        (
            Value::from("block_hashes"),
            Value::Array(vec![
                Value::Binary(vec![0xff; 24].into_iter().chain(1u64.to_be_bytes()).collect()),
                Value::from(-1),
            ]),
        ),
        (Value::from("future_field"), Value::from(true)),
        // The tag need not come first.
        (Value::from("type"), Value::from("BlockRemoved")),
    ]);
    let batch = Value::Map(vec![(Value::from("ts"), Value::F64(1.5)), (Value::from("events"), Value::Array(vec![ev]))]);
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &batch).expect("encode");
    let b = decode_batch(&buf).expect("decodes");
    assert_eq!(b.ts, 1.5);
    assert_eq!(
        b.events,
        vec![KvEvent::Removed {
            block_hashes: vec![EngineBlockHash(1), EngineBlockHash(u64::MAX)],
            medium: Medium::Gpu
        }]
    );
}

#[test]
fn malformed_input_is_an_error() {
    let good = frames("v0.33", 0);
    assert!(matches!(decode_message(&good[..1]), Err(KvEventError::Frames { .. })));
    assert!(matches!(decode_message(&[good[0].clone(), vec![1, 2], good[2].clone()]), Err(KvEventError::Seq(2))));
    // Cut before the events array: nothing to keep.
    assert!(matches!(
        decode_message(&[good[0].clone(), good[1].clone(), good[2][..5].to_vec()]),
        Err(KvEventError::Msgpack(_))
    ));
    assert!(matches!(decode_message(&[good[0].clone(), good[1].clone(), vec![0xc0]]), Err(KvEventError::Shape(_))));
    assert!(matches!(decode_batch(&[0xc1]), Err(KvEventError::Msgpack(_))));
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &Value::Array(vec![Value::F64(0.0), Value::from("events?")])).expect("encode");
    assert!(matches!(decode_batch(&buf), Err(KvEventError::Shape(_))));
    assert!(decode_replay(&[vec![1], vec![0; 8], vec![]]).is_err());
}

/// The fixture batch `n` of `folder` as a msgpack value tree.
fn fixture_value(folder: &str, n: usize) -> Value {
    let payload = &frames(folder, n)[2];
    rmpv::decode::read_value(&mut payload.as_slice()).expect("fixture is msgpack")
}

/// `batch` (a value tree) with its events replaced by `events`, encoded.
fn with_events(mut batch: Value, events: Vec<Value>) -> Vec<u8> {
    if let Value::Array(parts) = &mut batch {
        parts[1] = Value::Array(events);
    }
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &batch).expect("encode");
    buf
}

fn events_of(batch: &Value) -> Vec<Value> {
    batch.as_array().and_then(|p| p[1].as_array()).cloned().expect("events array")
}

/// An event of `kind` in the folder's shape (map for v0.33, positional array for legacy).
fn event(folder: &str, kind: &str, fields: Vec<(&str, Value)>) -> Value {
    if folder == "v0.33" {
        let mut m = vec![(Value::from("type"), Value::from(kind))];
        m.extend(fields.into_iter().map(|(k, v)| (Value::from(k), v)));
        Value::Map(m)
    } else {
        let mut a = vec![Value::from(kind)];
        a.extend(fields.into_iter().map(|(_, v)| v));
        Value::Array(a)
    }
}

#[test]
fn an_unknown_event_type_is_skipped_and_counted_and_the_rest_kept() {
    for folder in FOLDERS {
        // Batch 3 holds two BlockStored; a newer vLLM's event between them.
        let whole = fixture_value(folder, 3);
        let mut events = events_of(&whole);
        let newer = event(folder, "BlockPinned", vec![("block_hashes", Value::Array(vec![Value::from(7)]))]);
        events.insert(1, newer);
        events.push(event(folder, "BlockPinned", vec![]));
        events.push(event(folder, "CacheResized", vec![("num_gpu_blocks", Value::from(4))]));
        let b = decode_batch(&with_events(whole.clone(), events)).expect("decodes");
        let want = decode_message(&frames(folder, 3)).expect("fixture").batch;
        assert_eq!(b.events, want.events, "{folder}");
        assert_eq!(b.damage.unknown_events, 3);
        assert_eq!(b.damage.unknown_types, vec!["BlockPinned", "CacheResized"]);
        assert!(!b.untrusted() && !b.damage.truncated);
    }
}

#[test]
fn an_unreadable_store_is_skipped_but_an_unreadable_removal_is_untrusted() {
    for folder in FOLDERS {
        let whole = fixture_value(folder, 3);
        let mut events = events_of(&whole);
        let bad_store = event(
            folder,
            "BlockStored",
            vec![
                ("block_hashes", Value::Array(vec![Value::from(1)])),
                ("parent_block_hash", Value::Nil),
                ("token_ids", Value::from("x")),
            ],
        );
        let bad_removal = event(folder, "BlockRemoved", vec![("block_hashes", Value::from(true))]);
        events.insert(0, bad_store);
        events.insert(2, bad_removal);
        let b = decode_batch(&with_events(whole, events)).expect("decodes");
        let want = decode_message(&frames(folder, 3)).expect("fixture").batch.events;
        assert_eq!(b.events.len(), 3, "{folder}: {:?}", b.events);
        assert_eq!(b.events[0], want[0]);
        assert!(matches!(&b.events[1], KvEvent::Untrusted(why) if why.contains("BlockRemoved")), "{:?}", b.events[1]);
        assert_eq!(b.events[2], want[1]);
        assert_eq!(b.damage.skipped_events, 1);
        assert!(b.damage.first_skip_reason.as_deref().is_some_and(|r| r.contains("token_ids")));
    }
}

/// Byte offsets where each event of a fixture payload starts, and where the events end (the
/// fixtures are `[ts, [events…], rank]` with fewer than 16 events).
fn event_offsets(payload: &[u8]) -> (Vec<usize>, usize) {
    assert_eq!(payload[0], 0x93, "fixarray of 3");
    let mut rest = &payload[1..];
    rmpv::decode::read_value(&mut rest).expect("ts");
    let header = rest[0];
    assert_eq!(header & 0xf0, 0x90, "fixarray of events");
    rest = &rest[1..];
    let mut starts = Vec::new();
    for _ in 0..(header & 0x0f) {
        starts.push(payload.len() - rest.len());
        rmpv::decode::read_value(&mut rest).expect("event");
    }
    (starts, payload.len() - rest.len())
}

#[test]
fn a_payload_cut_short_keeps_its_whole_events_and_distrusts_only_what_may_be_lost() {
    for folder in FOLDERS {
        for n in 0..5 {
            let f = frames(folder, n);
            let payload = &f[2];
            let whole = decode_batch(payload).expect("fixture").events;
            let (starts, end) = event_offsets(payload);
            let Some(&first) = starts.first() else { continue };
            for cut in 1..payload.len() {
                let got = decode_message(&[f[0].clone(), f[1].clone(), payload[..cut].to_vec()]);
                if cut < first {
                    assert!(got.is_err(), "{folder}/{n} cut at {cut}: no events array yet");
                    continue;
                }
                let b = got.unwrap_or_else(|e| panic!("{folder}/{n} cut at {cut}: {e}")).batch;
                if cut >= end {
                    // Only the rank is missing: every event is there.
                    assert_eq!(b.events, whole);
                    continue;
                }
                // Events whose last byte is before the cut.
                let ends: Vec<usize> = starts.iter().skip(1).copied().chain([end]).collect();
                let complete = ends.iter().filter(|&&e| e <= cut).count();
                let kept: Vec<&KvEvent> = b.events.iter().filter(|e| !matches!(e, KvEvent::Untrusted(_))).collect();
                assert_eq!(kept, whole.iter().take(complete).collect::<Vec<_>>(), "{folder}/{n} cut at {cut}");
                assert!(b.damage.truncated);
                // Only the rest of one final BlockStored (its type read) is safe to lose.
                let in_last = complete + 1 == whole.len() && !starts.contains(&cut);
                let last_is_store = matches!(whole.last(), Some(KvEvent::Stored(_)));
                let type_read = cut > starts[complete] + 20;
                if in_last && last_is_store && type_read {
                    assert!(!b.untrusted(), "{folder}/{n} cut at {cut}: {:?}", b.events);
                }
                if !in_last {
                    assert!(matches!(b.events.last(), Some(KvEvent::Untrusted(_))), "{folder}/{n} cut at {cut}");
                }
            }
        }
    }
}

#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    // [0.0, [{"type": "BlockRemoved", "x": [[[…0…]]]}]], written by hand (a value tree this deep
    // would overflow the encoder's own stack).
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &Value::F64(0.0)).expect("encode");
    let mut payload = vec![0x92];
    payload.extend(buf);
    payload.extend([0x91, 0x82]);
    for s in ["type", "BlockRemoved", "x"] {
        rmpv::encode::write_value(&mut payload, &Value::from(s)).expect("encode");
    }
    payload.extend(std::iter::repeat_n(0x91, 100_000));
    payload.push(0);
    let b = decode_batch(&payload).expect("the events array was reached");
    assert!(b.untrusted() && b.damage.truncated, "{b:?}");
}

#[test]
fn oversized_names_make_an_event_unreadable() {
    let long = "l".repeat(MAX_NAME_BYTES + 1);
    let stored = Value::Map(vec![
        (Value::from("type"), Value::from("BlockStored")),
        (Value::from("block_hashes"), Value::Array(vec![Value::from(1)])),
        (Value::from("token_ids"), Value::Array((0..16).map(Value::from).collect())),
        (Value::from("block_size"), Value::from(16)),
        (Value::from("lora_name"), Value::from(long.as_str())),
    ]);
    let removed = Value::Map(vec![
        (Value::from("type"), Value::from("BlockRemoved")),
        (Value::from("block_hashes"), Value::Array(vec![Value::from(1)])),
        (Value::from("medium"), Value::from("m".repeat(MAX_MEDIUM_BYTES + 1).as_str())),
    ]);
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &Value::Array(vec![Value::F64(0.0), Value::Array(vec![stored, removed])]))
        .expect("encode");
    let b = decode_batch(&buf).expect("decodes");
    assert_eq!(b.damage.skipped_events, 1);
    assert!(matches!(&b.events[..], [KvEvent::Untrusted(_)]), "{:?}", b.events);
}
