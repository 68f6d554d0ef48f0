//! The example JSONL trace runs, and kvroute sends each conversation's second turn back to the pod
//! that holds its first.

use std::path::Path;

use kvroute_sim::policy;
use kvroute_sim::sim::{self, SimConfig};
use kvroute_sim::workload;

#[test]
fn example_trace_second_turns_return_to_their_pod() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/example.jsonl");
    let w = match workload::trace(&path, 16) {
        Ok(w) => w,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(w.requests.len(), 5);
    let cfg = SimConfig::default();
    let p = match policy::build("kvroute", cfg.pods, &policy::PolicyOptions::default()) {
        Ok(p) => p,
        Err(e) => panic!("{e}"),
    };
    let run = match sim::run(&w, &mut [p], &cfg, None) {
        Ok(r) => r,
        Err(e) => panic!("{e}"),
    };
    for session in [1, 3] {
        let turns: Vec<_> = run.outcomes.iter().filter(|o| o.session == Some(session)).collect();
        assert_eq!(turns.len(), 2);
        assert_eq!(turns[0].pod, turns[1].pod, "session {session}");
        assert!(turns[1].cached_tokens >= turns[0].prompt_tokens - 16, "session {session}: {turns:?}");
    }
}
