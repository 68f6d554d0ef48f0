//! The fixture's five batches, applied in order, against hashes computed independently from
//! `prompts.json` with `BlockHasher`.

use super::*;
use crate::engine::kv_events::decode_message;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

fn batch(folder: &str, n: usize) -> KvEventBatch {
    let dir = format!("{}/../tests/fixtures/vllm-kv-events/{folder}", env!("CARGO_MANIFEST_DIR"));
    let frames: Vec<Vec<u8>> = ["topic", "seq", "msgpack"]
        .iter()
        .map(|e| std::fs::read(format!("{dir}/batch-{n}.{e}")).expect("fixture"))
        .collect();
    decode_message(&frames).expect("decodes").batch
}

fn prompts() -> (Vec<u32>, Vec<u32>) {
    let path = format!("{}/../tests/fixtures/vllm-kv-events/v0.33/prompts.json", env!("CARGO_MANIFEST_DIR"));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).expect("prompts")).expect("json");
    let ids = |k: &str| -> Vec<u32> {
        v[k].as_array().expect("array").iter().map(|x| x.as_u64().expect("u64") as u32).collect()
    };
    (ids("prompt_a_token_ids"), ids("prompt_b_token_ids"))
}

fn chain(lora: Option<&str>, tokens: &[u32]) -> Vec<BlockHash> {
    let mut out = Vec::new();
    BlockHasher::new(MODEL, lora, 16).hash_prompt(tokens, &mut out);
    out
}

fn stored_hashes(c: &BlockChanges) -> Vec<u64> {
    c.stored.iter().flat_map(|r| r.hashes.iter().copied()).collect()
}

#[test]
fn fixture_batches_in_order() {
    for folder in ["v0.33", "legacy-array"] {
        let (a, b) = prompts();
        let (ca, cb) = (chain(None, &a), chain(None, &b));
        let mut rec = BlockRecord::new(MODEL, 16);

        let out = rec.apply(&batch(folder, 0));
        assert_eq!(out.stored_gpu, 3);
        let c = rec.take_changes();
        assert!(!c.cleared);
        assert_eq!(c.stored, vec![BlockRun { parent: 0, hashes: ca.iter().map(|h| h.0).collect() }]);

        rec.apply(&batch(folder, 1));
        let c = rec.take_changes();
        // B's blocks 3-4 chain from A's block 2 (the shared prefix).
        assert_eq!(c.stored, vec![BlockRun { parent: ca[1].0, hashes: vec![cb[2].0, cb[3].0] }]);
        assert_eq!(&cb[..2], &ca[..2]);
        assert_eq!(rec.gpu_len(), 5);

        rec.apply(&batch(folder, 2));
        let c = rec.take_changes();
        assert_eq!(c.removed, vec![ca[2].0]);
        assert!(c.stored.is_empty());
        assert!(!rec.contains(ca[2]) && rec.contains(ca[1]));

        rec.apply(&batch(folder, 3));
        let cpu = rec.take_offloaded_changes().expect("the CPU copy is reported");
        let c = rec.take_changes();
        // sql-lora: a separate chain; the CPU copy of A's first block goes to the CPU tier.
        let lora = chain(Some("sql-lora"), &a[..16]);
        assert_eq!(c.stored, vec![BlockRun { parent: 0, hashes: vec![lora[0].0] }]);
        assert_ne!(lora[0], ca[0]);
        assert_eq!(rec.gpu_len(), 5);
        assert_eq!(cpu.stored, vec![BlockRun { parent: 0, hashes: vec![ca[0].0] }]);
        assert_eq!(rec.cpu_len(), 1);
        assert_eq!(rec.offloaded_snapshot_runs(), cpu.stored);

        let mut snap: Vec<u64> = rec.snapshot_runs().iter().flat_map(|r| r.hashes.clone()).collect();
        snap.sort_unstable();
        let mut want = vec![ca[0].0, ca[1].0, cb[2].0, cb[3].0, lora[0].0];
        want.sort_unstable();
        assert_eq!(snap, want);

        rec.apply(&batch(folder, 4));
        let c = rec.take_changes();
        assert!(c.cleared && c.stored.is_empty() && c.removed.is_empty());
        assert_eq!(rec.gpu_len(), 0);
        assert!(rec.take_offloaded_changes().is_some_and(|c| c.cleared), "both tiers are cleared");
        assert!(!rec.has_changes());
    }
}

#[test]
fn unknown_parent_is_dropped_and_counted() {
    let mut rec = BlockRecord::new(MODEL, 16);
    let out = rec.apply(&batch("v0.33", 1));
    assert_eq!(out.dropped_unknown_parent, 2);
    assert_eq!(out.stored_gpu, 0);
    assert!(stored_hashes(&rec.take_changes()).is_empty());
}

#[test]
fn cpu_block_can_parent_a_gpu_block() {
    let (a, _) = prompts();
    let ca = chain(None, &a);
    let mut rec = BlockRecord::new(MODEL, 16);
    rec.apply(&KvEventBatch {
        ts: 0.0,
        events: vec![KvEvent::Stored(BlockStored {
            block_hashes: vec![EngineBlockHash(1)],
            parent: None,
            token_ids: a[..16].to_vec(),
            block_size: 16,
            lora_id: None,
            medium: Medium::Cpu,
            lora_name: None,
            extra_keys: vec![BlockExtra::Plain],
        })],
        dp_rank: None,
        damage: Default::default(),
    });
    // Reported in the CPU tier only.
    assert_eq!(rec.take_offloaded_changes().map(|c| stored_hashes(&c)), Some(vec![ca[0].0]));
    assert!(!rec.has_changes());
    rec.apply(&KvEventBatch {
        ts: 0.0,
        events: vec![KvEvent::Stored(BlockStored {
            block_hashes: vec![EngineBlockHash(2)],
            parent: Some(EngineBlockHash(1)),
            token_ids: a[16..32].to_vec(),
            block_size: 16,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            extra_keys: vec![BlockExtra::Opaque],
        })],
        dp_rank: None,
        damage: Default::default(),
    });
    // Uninterpretable extra keys: skipped.
    assert!(stored_hashes(&rec.take_changes()).is_empty());
    rec.apply(&KvEventBatch {
        ts: 0.0,
        events: vec![KvEvent::Stored(BlockStored {
            block_hashes: vec![EngineBlockHash(3)],
            parent: Some(EngineBlockHash(1)),
            token_ids: a[16..32].to_vec(),
            block_size: 16,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            extra_keys: vec![BlockExtra::Plain],
        })],
        dp_rank: None,
        damage: Default::default(),
    });
    let c = rec.take_changes();
    assert_eq!(c.stored, vec![BlockRun { parent: ca[0].0, hashes: vec![ca[1].0] }]);
}

#[test]
fn store_then_remove_within_a_window_nets_out() {
    let mut rec = BlockRecord::new(MODEL, 16);
    rec.apply(&batch("v0.33", 0));
    rec.apply(&batch("v0.33", 1));
    rec.apply(&batch("v0.33", 2));
    let c = rec.take_changes();
    let (a, _) = prompts();
    let ca = chain(None, &a);
    let stored = stored_hashes(&c);
    assert_eq!(stored.len(), 4);
    assert!(!stored.contains(&ca[2].0));
    assert!(c.removed.iter().all(|r| !stored.contains(r)));
}

#[test]
fn set_model_clears() {
    let mut rec = BlockRecord::new("other-model", 16);
    rec.apply(&batch("v0.33", 0));
    rec.take_changes();
    rec.set_model(MODEL);
    assert_eq!(rec.gpu_len(), 0);
    assert!(rec.take_changes().cleared);
}

fn one_block(hash: u64, parent: Option<u64>, tokens: &[u32], medium: Medium) -> KvEventBatch {
    KvEventBatch {
        ts: 0.0,
        events: vec![KvEvent::Stored(BlockStored {
            block_hashes: vec![EngineBlockHash(hash)],
            parent: parent.map(EngineBlockHash),
            token_ids: tokens.to_vec(),
            block_size: 16,
            lora_id: None,
            medium,
            lora_name: None,
            extra_keys: vec![BlockExtra::Plain],
        })],
        dp_rank: None,
        damage: Default::default(),
    }
}

#[test]
fn block_on_another_medium_can_parent_a_gpu_block() {
    let (a, _) = prompts();
    let ca = chain(None, &a);
    let mut rec = BlockRecord::new(MODEL, 16);
    let disk = Medium::Other("disk".into());
    rec.apply(&one_block(1, None, &a[..16], disk.clone()));
    assert!(!rec.has_changes());
    // Its parent lives only on "disk": found there, the GPU block chains from it.
    let out = rec.apply(&one_block(2, Some(1), &a[16..32], Medium::Gpu));
    assert_eq!((out.stored_gpu, out.dropped_unknown_parent), (1, 0));
    assert_eq!(rec.take_changes().stored, vec![BlockRun { parent: ca[0].0, hashes: vec![ca[1].0] }]);
    // Removed from "disk": a later child of it is an unknown parent again.
    rec.apply(&KvEventBatch {
        ts: 0.0,
        events: vec![KvEvent::Removed { block_hashes: vec![EngineBlockHash(1)], medium: disk }],
        dp_rank: None,
        damage: Default::default(),
    });
    let out = rec.apply(&one_block(3, Some(1), &a[16..32], Medium::Gpu));
    assert_eq!(out.dropped_unknown_parent, 1);
}

#[test]
fn removal_from_a_medium_never_seen_changes_nothing() {
    let (a, _) = prompts();
    let mut rec = BlockRecord::new(MODEL, 16);
    rec.apply(&one_block(1, None, &a[..16], Medium::Gpu));
    rec.take_changes();
    rec.apply(&KvEventBatch {
        ts: 0.0,
        events: vec![KvEvent::Removed { block_hashes: vec![EngineBlockHash(1)], medium: Medium::Other("nvme".into()) }],
        dp_rank: None,
        damage: Default::default(),
    });
    assert!(!rec.has_changes());
    assert_eq!(rec.gpu_len(), 1);
}

#[test]
fn salted_and_multimodal_blocks_hash_like_the_picker() {
    use kvroute_common::{BlockKeys, ExtraKey, MmItem};
    let (a, _) = prompts();
    let keys = BlockKeys {
        cache_salt: Some("tenant-1".into()),
        items: vec![MmItem { identifier: "img-1".into(), offset: 20, length: 8 }],
    };
    // What the picker computes for the request.
    let mut want = Vec::new();
    BlockHasher::new(MODEL, None, 16).hash_prompt_keyed(&a[..48], &keys, &mut want);
    // What vLLM sends: block 0 carries the salt, block 1 the image (offset 20 − 16 = 4).
    let mut rec = BlockRecord::new(MODEL, 16);
    rec.apply(&KvEventBatch {
        ts: 0.0,
        events: vec![KvEvent::Stored(BlockStored {
            block_hashes: vec![EngineBlockHash(1), EngineBlockHash(2), EngineBlockHash(3)],
            parent: None,
            token_ids: a[..48].to_vec(),
            block_size: 16,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            extra_keys: vec![
                BlockExtra::Keys(vec![ExtraKey::Str("tenant-1".into())]),
                BlockExtra::Keys(vec![ExtraKey::Item("img-1".into(), 4)]),
                BlockExtra::Plain,
            ],
        })],
        dp_rank: None,
        damage: Default::default(),
    });
    assert_eq!(stored_hashes(&rec.take_changes()), want.iter().map(|h| h.0).collect::<Vec<_>>());
    // The unsalted chain of the same tokens shares nothing with it.
    assert!(chain(None, &a[..48]).iter().all(|h| !want.contains(h)));
}

/// docs/design.md §2, inline images: vLLM keys the blocks an image's placeholders cover with
/// `[identifier, offset − block start]`, the identifier a 64-digit BLAKE3 hex digest for an image
/// without `uuid`. An image of 40 tokens from offset 20 spans blocks 1..=3 (offsets 4, −12, −28);
/// the agent's fold of those keys equals the picker's chain for the same request, and another
/// identifier (another image) shares only the block before it.
#[test]
fn inline_image_identifiers_fold_like_the_picker() {
    use kvroute_common::{BlockKeys, ExtraKey, MmItem};
    let a: Vec<u32> = (1000..1064).collect();
    let id = "9f2c0e5b7a1d4c3e8b6a5f4e3d2c1b0a9f8e7d6c5b4a39281706f5e4d3c2b1a0";
    let picker = |identifier: &str| {
        let keys = BlockKeys {
            cache_salt: None,
            items: vec![MmItem { identifier: identifier.into(), offset: 20, length: 40 }],
        };
        let mut want = Vec::new();
        BlockHasher::new(MODEL, None, 16).hash_prompt_keyed(&a[..64], &keys, &mut want);
        want
    };
    let engine = |identifier: &str| {
        let item = |offset| BlockExtra::Keys(vec![ExtraKey::Item(identifier.into(), offset)]);
        let mut rec = BlockRecord::new(MODEL, 16);
        rec.apply(&KvEventBatch {
            ts: 0.0,
            events: vec![KvEvent::Stored(BlockStored {
                block_hashes: (1..=4).map(EngineBlockHash).collect(),
                parent: None,
                token_ids: a[..64].to_vec(),
                block_size: 16,
                lora_id: None,
                medium: Medium::Gpu,
                lora_name: None,
                extra_keys: vec![BlockExtra::Plain, item(4), item(-12), item(-28)],
            })],
            dp_rank: None,
            damage: Default::default(),
        });
        stored_hashes(&rec.take_changes())
    };
    let want = picker(id);
    assert_eq!(engine(id), want.iter().map(|h| h.0).collect::<Vec<_>>());
    let other = engine(&id.replace('9', "8"));
    assert_eq!(other[0], want[0].0, "the block before the image is shared");
    assert!(other[1..].iter().all(|h| !want.iter().any(|w| w.0 == *h)), "another image: another chain from it on");
}

/// One GPU block `hash` of `tokens` under adapter `lora`, no parent.
fn lora_block(hash: u64, lora: &str, tokens: &[u32]) -> KvEventBatch {
    let mut b = one_block(hash, None, tokens, Medium::Gpu);
    if let KvEvent::Stored(s) = &mut b.events[0] {
        s.lora_name = Some(lora.to_string());
    }
    b
}

#[test]
fn a_full_record_drops_new_stores_counted_until_removals_make_room() {
    for folder in ["v0.33", "legacy-array"] {
        let (a, b) = prompts();
        let (ca, cb) = (chain(None, &a), chain(None, &b));
        let mut rec = BlockRecord::new(MODEL, 16);
        assert_eq!(rec.capacity(), DEFAULT_MAX_BLOCKS);
        rec.set_capacity(4);
        assert_eq!(rec.apply(&batch(folder, 0)).stored_gpu, 3);
        // Batch 1 stores B's two own blocks: one fits, the other (its child) is dropped.
        let out = rec.apply(&batch(folder, 1));
        assert_eq!((out.stored_gpu, out.dropped_capacity), (1, 1), "{folder}");
        assert_eq!(rec.len(), 4);
        assert!(rec.contains(cb[2]) && !rec.contains(cb[3]));
        // Batch 2 removes A's third block: room for one more, which batch 3's LoRA block takes;
        // its CPU copy of A's first block no longer fits.
        rec.apply(&batch(folder, 2));
        let out = rec.apply(&batch(folder, 3));
        assert_eq!((out.stored_gpu, out.dropped_capacity), (1, 1), "{folder}");
        assert_eq!(rec.len(), 4);
        assert!(rec.contains(ca[0]) && !rec.contains(ca[2]));
        // Re-storing A's chain: its two blocks still held need no room, the removed third does.
        let out = rec.apply(&batch(folder, 0));
        assert_eq!((out.stored_gpu, out.dropped_capacity), (0, 1), "{folder}");
    }
}

#[test]
fn adapters_are_found_by_name_and_their_index_stays_bounded() {
    let (a, _) = prompts();
    let mut rec = BlockRecord::new(MODEL, 16);
    let adapters = MAX_HASHED_ADAPTERS + 100;
    for i in 0..adapters {
        let name = format!("adapter-{i}");
        rec.apply(&lora_block(i as u64, &name, &a[..16]));
        assert!(rec.lora_hashers.len() <= MAX_HASHED_ADAPTERS);
    }
    assert_eq!(rec.gpu_len(), adapters);
    // Each block was hashed under its own adapter's root, before and after the index was reset.
    for i in [0, MAX_HASHED_ADAPTERS - 1, MAX_HASHED_ADAPTERS, adapters - 1] {
        assert!(rec.contains(chain(Some(&format!("adapter-{i}")), &a[..16])[0]), "adapter-{i}");
    }
    // The base model and a second block size have their own roots.
    rec.apply(&one_block(u64::MAX, None, &a[..16], Medium::Gpu));
    assert!(rec.contains(chain(None, &a[..16])[0]));
}

#[test]
fn stores_on_media_past_the_limit_are_dropped_counted() {
    let (a, _) = prompts();
    let mut rec = BlockRecord::new(MODEL, 16);
    let mut dropped = 0;
    for i in 0..MAX_MEDIA as u64 + 4 {
        let out = rec.apply(&one_block(i, None, &a[..16], Medium::Other(format!("tier-{i}"))));
        dropped += out.dropped_capacity;
    }
    // GPU and CPU are two of the limit's media; 14 others fit.
    assert_eq!(dropped, 6);
    assert_eq!(rec.len(), MAX_MEDIA - 2);
}

/// A run of `tokens.len() / block_size` engine blocks (hashes `first..`) from the chain's start.
fn engine_run(first: u64, tokens: &[u32], block_size: u32, extra_keys: Vec<BlockExtra>) -> KvEventBatch {
    let n = tokens.len() / block_size as usize;
    KvEventBatch {
        ts: 0.0,
        events: vec![KvEvent::Stored(BlockStored {
            block_hashes: (0..n as u64).map(|i| EngineBlockHash(first + i)).collect(),
            parent: None,
            token_ids: tokens.to_vec(),
            block_size,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            extra_keys,
        })],
        dp_rank: None,
        damage: Default::default(),
    }
}

fn removed(hashes: &[u64]) -> KvEventBatch {
    KvEventBatch {
        ts: 0.0,
        events: vec![KvEvent::Removed {
            block_hashes: hashes.iter().copied().map(EngineBlockHash).collect(),
            medium: Medium::Gpu,
        }],
        dp_rank: None,
        damage: Default::default(),
    }
}

/// docs/design.md §2 index granularity: engines of 16-, 32- and 64-token blocks all land on the
/// picker's 16-token chain, and removing one engine block removes exactly its index blocks.
#[test]
fn engine_blocks_of_any_multiple_land_on_the_index_chain() {
    let a: Vec<u32> = (5000..5128).collect();
    let tokens = &a[..];
    let want = chain(None, tokens);
    for engine_block in [16u32, 32, 64] {
        let per = (engine_block / 16) as usize;
        let n = tokens.len() / engine_block as usize;
        let mut rec = BlockRecord::new(MODEL, 16);
        let out = rec.apply(&engine_run(1, tokens, engine_block, vec![BlockExtra::Plain; n]));
        assert_eq!(out.stored_gpu as usize, want.len(), "{engine_block}-token engine: index blocks announced");
        assert_eq!(rec.len(), n, "{engine_block}-token engine: one record entry per engine block");
        let c = rec.take_changes();
        assert_eq!(stored_hashes(&c), want.iter().map(|h| h.0).collect::<Vec<_>>(), "{engine_block}-token engine");
        // The last engine block goes: its `per` index blocks, and nothing else.
        rec.apply(&removed(&[n as u64]));
        let c = rec.take_changes();
        let mut gone = c.removed.clone();
        gone.sort_unstable();
        let mut expect: Vec<u64> = want[want.len() - per..].iter().map(|h| h.0).collect();
        expect.sort_unstable();
        assert_eq!(gone, expect, "{engine_block}-token engine: removal of its last block");
        assert_eq!(rec.gpu_len(), want.len() - per);
        // A later store whose parent is the first engine block chains from its last index block.
        let mut rec2 = BlockRecord::new(MODEL, 16);
        let bs = engine_block as usize;
        rec2.apply(&engine_run(1, &tokens[..bs], engine_block, vec![BlockExtra::Plain]));
        rec2.take_changes();
        let mut child = engine_run(2, &tokens[bs..2 * bs], engine_block, vec![BlockExtra::Plain]);
        if let KvEvent::Stored(s) = &mut child.events[0] {
            s.parent = Some(EngineBlockHash(1));
        }
        rec2.apply(&child);
        let c = rec2.take_changes();
        assert_eq!(
            c.stored,
            vec![BlockRun { parent: want[per - 1].0, hashes: want[per..2 * per].iter().map(|h| h.0).collect() }]
        );
    }
}

#[test]
fn engine_blocks_not_a_multiple_of_the_index_block_are_dropped_counted() {
    let a: Vec<u32> = (5000..5128).collect();
    let mut rec = BlockRecord::new(MODEL, 16);
    let out = rec.apply(&engine_run(1, &a[..48], 24, vec![BlockExtra::Plain; 2]));
    assert_eq!((out.dropped_block_size, out.stored_gpu), (2, 0));
    assert!(rec.is_empty() && !rec.has_changes());
    // A 32-token index under 16-token engine blocks cannot be placed either.
    let mut rec = BlockRecord::new(MODEL, 32);
    let out = rec.apply(&engine_run(1, &a[..32], 16, vec![BlockExtra::Plain; 2]));
    assert_eq!(out.dropped_block_size, 2);
}

/// A salted request on a 32-token engine: vLLM keys its first engine block with the salt; the
/// picker keys the first 16-token index block. Both chains agree. A multimodal item cannot be
/// placed on index blocks inside a larger engine block: skipped, counted, nothing claimed from it.
#[test]
fn salt_on_a_larger_engine_block_goes_to_its_first_index_block() {
    use kvroute_common::{BlockKeys, ExtraKey};
    let a: Vec<u32> = (5000..5128).collect();
    let keys = BlockKeys { cache_salt: Some("tenant-1".into()), items: Vec::new() };
    let mut want = Vec::new();
    BlockHasher::new(MODEL, None, 16).hash_prompt_keyed(&a[..64], &keys, &mut want);
    let mut rec = BlockRecord::new(MODEL, 16);
    rec.apply(&engine_run(
        1,
        &a[..64],
        32,
        vec![BlockExtra::Keys(vec![ExtraKey::Str("tenant-1".into())]), BlockExtra::Plain],
    ));
    assert_eq!(stored_hashes(&rec.take_changes()), want.iter().map(|h| h.0).collect::<Vec<_>>());

    let mut rec = BlockRecord::new(MODEL, 16);
    let out = rec.apply(&engine_run(
        1,
        &a[..64],
        32,
        vec![BlockExtra::Plain, BlockExtra::Keys(vec![ExtraKey::Item("img-1".into(), 4)])],
    ));
    assert_eq!(
        (out.stored_gpu, out.skipped_extra_keys),
        (2, 1),
        "the first engine block is placed, the image's is not"
    );
}

/// vLLM holds two physical copies of one block hash when a fully cached prompt of whole blocks
/// recomputes its last block, stores the copy again, and sends a BlockRemoved for each copy it
/// evicts: the block stays recorded until its last copy goes.
#[test]
fn a_block_stored_twice_stays_until_both_copies_are_removed() {
    let a: Vec<u32> = (5000..5032).collect();
    let want = chain(None, &a);
    let mut rec = BlockRecord::new(MODEL, 16);
    rec.apply(&engine_run(1, &a, 32, vec![BlockExtra::Plain]));
    let out = rec.apply(&engine_run(1, &a, 32, vec![BlockExtra::Plain]));
    assert_eq!(out.stored_gpu, 0, "a second copy announces nothing new");
    assert_eq!(stored_hashes(&rec.take_changes()), want.iter().map(|h| h.0).collect::<Vec<_>>());
    rec.apply(&removed(&[1]));
    assert!(!rec.has_changes(), "one copy is still cached");
    assert_eq!(rec.gpu_len(), 2);
    rec.apply(&removed(&[1]));
    let mut gone = rec.take_changes().removed;
    gone.sort_unstable();
    let mut expect: Vec<u64> = want.iter().map(|h| h.0).collect();
    expect.sort_unstable();
    assert_eq!(gone, expect);
    assert!(rec.is_empty());
}
