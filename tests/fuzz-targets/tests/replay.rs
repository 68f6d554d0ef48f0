//! Replays every fuzz input kept in the repository through its target under plain `cargo test`
//! (no nightly, no libFuzzer): the corpus (`fuzz/corpus/<target>/`, seeds and what the fuzzer
//! found worth keeping), one input per finding fixed (`fuzz/regressions/<target>/`, which must
//! stay fixed) and the fuzzer's raw findings of a local run (`fuzz/artifacts/<target>/`, not committed), so an
//! unfixed finding fails the test where it was found.

use kvroute_fuzz_targets::TARGETS;
use std::path::{Path, PathBuf};

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(Result::ok).map(|e| e.path()).filter(|p| p.is_file()).collect())
        .unwrap_or_default();
    out.sort();
    out
}

#[test]
fn every_corpus_input_and_artifact_runs_clean() {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    for (name, target) in TARGETS {
        let corpus = files(&fuzz.join("corpus").join(name));
        assert!(!corpus.is_empty(), "fuzz/corpus/{name} has no inputs");
        let regressions = files(&fuzz.join("regressions").join(name));
        let artifacts = files(&fuzz.join("artifacts").join(name));
        for path in corpus.iter().chain(&regressions).chain(&artifacts) {
            let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let run = std::panic::catch_unwind(|| target(&data));
            assert!(run.is_ok(), "{name}: {} panics", path.display());
        }
        eprintln!(
            "{name}: {} corpus inputs, {} regressions, {} local artifacts replayed",
            corpus.len(),
            regressions.len(),
            artifacts.len()
        );
    }
}
