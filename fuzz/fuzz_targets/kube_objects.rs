#![no_main]
// The `kube_objects` target: see tests/fuzz-targets/src/lib.rs.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz_targets::kube_objects(data));
