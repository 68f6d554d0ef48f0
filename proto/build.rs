//! Compiles `proto/kvroute/agent/v1/agent.proto` and `proto/kvroute/replica/v1/replica.proto` with a
//! vendored `protoc`, so no system protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure().compile_with_config(
        config,
        &["proto/kvroute/agent/v1/agent.proto", "proto/kvroute/replica/v1/replica.proto"],
        &["proto"],
    )?;
    Ok(())
}
