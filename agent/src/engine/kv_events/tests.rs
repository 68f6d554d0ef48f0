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
    let truncated = good[2][..good[2].len() / 2].to_vec();
    assert!(decode_message(&[good[0].clone(), good[1].clone(), truncated]).is_err());
    assert!(matches!(decode_message(&[good[0].clone(), good[1].clone(), vec![0xc0]]), Err(KvEventError::Shape(_))));
    let mut buf = Vec::new();
    let bad = Value::Array(vec![Value::F64(0.0), Value::Array(vec![Value::Array(vec![Value::from("Bogus")])])]);
    rmpv::encode::write_value(&mut buf, &bad).expect("encode");
    assert!(matches!(decode_batch(&buf), Err(KvEventError::Shape(_))));
    assert!(decode_replay(&[vec![1], vec![0; 8], vec![]]).is_err());
}
