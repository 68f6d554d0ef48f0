#![no_main]
// The `gie_config` target: see tests/fuzz-targets/src/lib.rs.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz_targets::gie_config(data));
