#![no_main]
// The `agent_token` target: see tests/fuzz-targets/src/lib.rs.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz_targets::agent_token(data));
