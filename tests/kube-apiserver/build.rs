//! Compiles the kubelet PodResources v1 proto (server side) from the one copy in `cluster/proto`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    println!("cargo:rerun-if-changed=../../cluster/proto");
    tonic_prost_build::configure().build_client(false).compile_with_config(
        config,
        &["../../cluster/proto/kubelet/podresources/v1/api.proto"],
        &["../../cluster/proto"],
    )?;
    Ok(())
}
