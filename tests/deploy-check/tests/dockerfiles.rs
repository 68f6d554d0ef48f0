//! The Dockerfiles in deploy/docker against the workspace and the manifests: multi-stage, built
//! with a Rust image at least the workspace's rust-version, the binary built is the one shipped and
//! started, the runtime stage is distroless and runs as the uid the pods require, and EXPOSE lists
//! exactly the container ports of the workload that runs the image.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use kvroute_deploy_check::render::split_documents;
use kvroute_deploy_check::{parse_all, render};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// Instructions with line continuations joined, comments dropped.
fn instructions(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('#') || t.is_empty() {
            continue;
        }
        if let Some(head) = t.strip_suffix('\\') {
            cur.push_str(head);
            cur.push(' ');
        } else {
            cur.push_str(t);
            out.push(std::mem::take(&mut cur));
        }
    }
    out
}

fn workspace_rust_version() -> (u32, u32) {
    let toml = std::fs::read_to_string(repo_root().join("Cargo.toml")).unwrap();
    let line = toml.lines().find(|l| l.starts_with("rust-version")).unwrap();
    let v = line.split('"').nth(1).unwrap();
    let mut parts = v.split('.').map(|p| p.parse::<u32>().unwrap());
    (parts.next().unwrap(), parts.next().unwrap())
}

fn check(binary: &str, workload: &str) {
    let path = repo_root().join(format!("deploy/docker/{}.Dockerfile", binary.trim_start_matches("kvroute-")));
    let ins = instructions(&std::fs::read_to_string(&path).unwrap());
    let froms: Vec<_> = ins.iter().filter(|i| i.starts_with("FROM ")).collect();
    assert_eq!(froms.len(), 2, "{binary}: build stage + runtime stage");
    let rust = froms[0].trim_start_matches("FROM rust:").split(['-', ' ']).next().unwrap();
    let mut v = rust.split('.').map(|p| p.parse::<u32>().unwrap());
    let (want_major, want_minor) = workspace_rust_version();
    assert!((v.next().unwrap(), v.next().unwrap()) >= (want_major, want_minor), "{binary}: rust image {rust} too old");
    assert!(froms[1].starts_with("FROM gcr.io/distroless/cc-"), "{binary}: runtime stage {}", froms[1]);
    let run = ins.iter().find(|i| i.contains("cargo build")).unwrap();
    assert!(run.contains(&format!("--locked -p {binary} --bin {binary}")), "{run}");
    assert!(ins.iter().any(|i| i == &format!("COPY --from=build /out/{binary} /usr/local/bin/{binary}")));
    assert!(ins.contains(&format!("ENTRYPOINT [\"/usr/local/bin/{binary}\"]")), "{binary}: entrypoint");
    assert!(ins.contains(&"USER 65532:65532".to_string()), "{binary}: non-root user");
    let mut exposed: Vec<i32> = ins
        .iter()
        .filter_map(|i| i.strip_prefix("EXPOSE "))
        .flat_map(|p| p.split_whitespace().map(|n| n.parse::<i32>().unwrap()))
        .collect();
    exposed.sort_unstable();

    // The workload that runs this image: same ports, same uid.
    let text = render(&repo_root().join("deploy/k8s/overlays/standalone")).unwrap();
    let r = parse_all(&split_documents(&text).unwrap()).unwrap();
    let w = r.workload(workload).unwrap();
    let spec = w.template.spec.as_ref().unwrap();
    let c = spec.containers.iter().find(|c| c.image.as_deref().unwrap_or("").contains(binary)).unwrap();
    let mut ports: Vec<i32> = c.ports.as_deref().unwrap_or(&[]).iter().map(|p| p.container_port).collect();
    ports.sort_unstable();
    assert_eq!(exposed, ports, "{binary}: EXPOSE vs {workload} container ports");
    // The image's user, except the agent's uid 0 for the kubelet's root-only PodResources socket
    // (with every capability dropped: checks::refs holds it to that).
    let want_uid = if binary == "kvroute-agent" { 0 } else { 65532 };
    assert_eq!(spec.security_context.as_ref().and_then(|s| s.run_as_user), Some(want_uid), "{binary}: uid");
}

#[test]
fn picker_dockerfile_matches_workspace_and_manifests() {
    check("kvroute-picker", "kvroute-picker");
}

#[test]
fn agent_dockerfile_matches_workspace_and_manifests() {
    check("kvroute-agent", "kvroute-agent");
}

#[test]
fn instructions_join_continuations_and_drop_comments() {
    assert_eq!(instructions("# c\nRUN a \\\n  b\nUSER x\n"), ["RUN a  b", "USER x"]);
}
