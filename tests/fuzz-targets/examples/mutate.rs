//! A mutation fuzzer without libFuzzer, for machines where `scripts/fuzz`'s instrumented build does
//! not fit: takes each target's kept inputs (`fuzz/corpus/`, `fuzz/regressions/`), applies 1–4
//! random byte mutations (flip, insert, delete, duplicate a range, truncate, splice with another
//! input, set an interesting value) and runs the target under `catch_unwind`. No coverage
//! guidance: it finds what random edits of real inputs reach, and is no substitute for
//! `scripts/fuzz`. A panicking input is written to `fuzz/artifacts/<target>/crash-<hash>` (which
//! the replay test then runs) and the run exits 1.
//!
//! `cargo run --release -p kvroute-fuzz-targets --example mutate -- [TARGET…]`; environment:
//! `MUTATE_RUNS` (executions per target, default 100 000), `MUTATE_SECS` (seconds per target,
//! default 60), `MUTATE_SEED` (default 1). Prints executions and findings per target.

use kvroute_fuzz_targets::TARGETS;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// xorshift64*: reproducible from `MUTATE_SEED`, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 { 0 } else { (self.next() % n as u64) as usize }
    }
}

fn inputs(root: &Path, name: &str) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for dir in ["corpus", "regressions"] {
        let Ok(rd) = std::fs::read_dir(root.join(dir).join(name)) else { continue };
        let mut paths: Vec<PathBuf> = rd.filter_map(Result::ok).map(|e| e.path()).collect();
        paths.sort();
        out.extend(paths.iter().filter_map(|p| std::fs::read(p).ok()));
    }
    out
}

const INTERESTING: &[&[u8]] = &[
    b"0",
    b"-1",
    b"4294967295",
    b"18446744073709551616",
    b"1e308",
    b"NaN",
    b"null",
    b"[]",
    b"{}",
    b"\"\"",
    b"\xff\xff\xff\xff",
    b"\x00",
    b"\xc1",
    b"\xdc\xff\xff",
    b"\xdd\xff\xff\xff\xff",
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff",
];

fn mutate(rng: &mut Rng, seed: &[u8], other: &[u8]) -> Vec<u8> {
    let mut d = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        let len = d.len();
        match rng.below(7) {
            0 if len > 0 => {
                let i = rng.below(len);
                d[i] ^= 1 << rng.below(8);
            }
            1 => {
                let i = rng.below(len + 1);
                d.insert(i, rng.next() as u8);
            }
            2 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(64));
                d.drain(i..i + n);
            }
            3 if len > 0 && len < 1 << 16 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(256));
                let chunk = d[i..i + n].to_vec();
                let at = rng.below(d.len() + 1);
                d.splice(at..at, chunk);
            }
            4 if len > 0 => d.truncate(rng.below(len)),
            5 if !other.is_empty() => {
                let cut = rng.below(len + 1);
                let from = rng.below(other.len());
                d.truncate(cut);
                d.extend_from_slice(&other[from..]);
            }
            _ => {
                let v = INTERESTING[rng.below(INTERESTING.len())];
                let i = rng.below(len + 1);
                let n = rng.below((len - i).min(v.len()) + 1);
                d.splice(i..i + n, v.iter().copied());
            }
        }
    }
    d
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let wanted: Vec<String> = std::env::args().skip(1).collect();
    let (runs, secs) = (env("MUTATE_RUNS", 100_000), env("MUTATE_SECS", 60));
    let mut rng = Rng(env("MUTATE_SEED", 1).max(1));
    // Panics are expected findings: keep their messages short and on one line.
    std::panic::set_hook(Box::new(|info| eprintln!("panic: {info}")));
    let mut failed = false;
    for (name, target) in TARGETS {
        if !wanted.is_empty() && !wanted.iter().any(|w| w == name) {
            continue;
        }
        let seeds = inputs(&root, name);
        if seeds.is_empty() {
            println!("{name:<16} no inputs");
            continue;
        }
        let (start, mut execs, mut found) = (Instant::now(), 0u64, 0u32);
        while execs < runs && start.elapsed() < Duration::from_secs(secs) {
            let seed = &seeds[rng.below(seeds.len())];
            let other = &seeds[rng.below(seeds.len())];
            let data = mutate(&mut rng, seed, other);
            execs += 1;
            if std::panic::catch_unwind(|| target(&data)).is_err() {
                found += 1;
                let hash = {
                    use std::hash::{Hash, Hasher};
                    let mut h = std::collections::hash_map::DefaultHasher::new();
                    data.hash(&mut h);
                    h.finish()
                };
                let dir = root.join("artifacts").join(name);
                let _ = std::fs::create_dir_all(&dir);
                let path = dir.join(format!("crash-{hash:016x}"));
                let _ = std::fs::write(&path, &data);
                eprintln!("{name}: finding written to {}", path.display());
                if found >= 5 {
                    break;
                }
            }
        }
        failed |= found > 0;
        let rate = execs as f64 / start.elapsed().as_secs_f64().max(1e-9);
        println!("{name:<16} {execs:>9} executions  {rate:>8.0}/s  {found:>2} findings");
    }
    std::process::exit(i32::from(failed));
}
