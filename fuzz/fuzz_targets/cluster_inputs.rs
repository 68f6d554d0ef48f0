#![no_main]
// The `cluster_inputs` target: see tests/fuzz-targets/src/lib.rs.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz_targets::cluster_inputs(data));
