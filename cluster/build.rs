//! Compiles the kubelet PodResources v1 proto (client side) with a vendored `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure().build_server(false).compile_with_config(
        config,
        &["proto/kubelet/podresources/v1/api.proto"],
        &["proto"],
    )?;
    Ok(())
}
