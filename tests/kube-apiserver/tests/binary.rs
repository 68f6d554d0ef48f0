//! The stand-in binary: objects from YAML, a kubeconfig that kube-rs loads, lists through it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use k8s_openapi::api::core::v1::Pod;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};

struct Kill(std::process::Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn binary_serves_objects_to_a_kubeconfig_client() {
    let dir = tempfile::tempdir().unwrap();
    let objects = dir.path().join("objects.yaml");
    std::fs::write(
        &objects,
        "apiVersion: v1\nkind: Pod\nmetadata: {name: vllm-0, namespace: demo, labels: {app: vllm}}\nspec: {nodeName: n1, containers: [{name: vllm, image: x}]}\nstatus: {podIP: 127.0.0.1}\n---\napiVersion: inference.networking.k8s.io/v1\nkind: InferencePool\nmetadata: {name: pool, namespace: demo}\nspec: {selector: {matchLabels: {app: vllm}}, targetPorts: [{number: 8000}]}\n",
    )
    .unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    let mut child = Command::new(env!("CARGO_BIN_EXE_kube-apiserver-stand-in"))
        .args(["--listen", "127.0.0.1:0", "--namespace", "demo", "--objects"])
        .arg(&objects)
        .arg("--kubeconfig-out")
        .arg(&kubeconfig)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let _guard = Kill(child);
    let url = BufReader::new(stdout).lines().next().unwrap().unwrap();
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");

    let kc = Kubeconfig::read_from(&kubeconfig).unwrap();
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.unwrap();
    assert_eq!(config.default_namespace, "demo");
    let client = Client::try_from(config).unwrap();
    let pods = Api::<Pod>::default_namespaced(client).list(&Default::default()).await.unwrap();
    assert_eq!(pods.items.len(), 1);
    assert_eq!(pods.items[0].status.as_ref().unwrap().pod_ip.as_deref(), Some("127.0.0.1"));
}
