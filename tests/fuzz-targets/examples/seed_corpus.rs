//! Writes the seed inputs of every fuzz target into `fuzz/corpus/<target>/seed-*` from real
//! data: the vLLM fixtures (KV-event batches, `/metrics` pages, chat requests), the shipped
//! config files, and OpenAI request bodies of every shape. Run once when the seeds change:
//! `cargo run -p kvroute-fuzz-targets --example seed_corpus`.

use kvroute_proto::agent::v1::{
    AgentMessage, BlockChanges, BlockRun, Hello, PodDelta, PodInfo, PodSnapshot, PodStats, agent_message,
};
use prost::Message;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn write(target: &str, name: &str, data: &[u8]) -> std::io::Result<()> {
    let dir = root().join("fuzz/corpus").join(target);
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join(format!("seed-{name}")), data)
}

fn main() -> std::io::Result<()> {
    // ext_proc bodies: byte 0 = path (0 completions, 1 chat) | model selector << 2.
    let bodies: &[(u8, &str, &str)] = &[
        (0, "completion-text", r#"{"model":"approx","prompt":"Once upon a time there was a router","max_tokens":8}"#),
        (0, "completion-tokens", r#"{"model":"qwen","prompt":[151644,872,198,9707,11,1879],"max_tokens":1}"#),
        (
            0,
            "completion-batch",
            r#"{"model":"qwen","prompt":[[1,2,3]],"stream":true,"stream_options":{"include_usage":true}}"#,
        ),
        (0, "completion-batch-many", r#"{"model":"approx","prompt":["a","b"]}"#),
        (
            1,
            "chat-simple",
            r#"{"model":"qwen","messages":[{"role":"system","content":"You are helpful."},{"role":"user","content":"Hi"}]}"#,
        ),
        (
            1,
            "chat-parts",
            r#"{"model":"qwen","messages":[{"role":"user","content":[{"type":"text","text":"What is this?"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]}"#,
        ),
        (
            1,
            "chat-tools",
            r#"{"model":"qwen","messages":[{"role":"user","content":"Weather in Paris?"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},{"role":"tool","tool_call_id":"c1","content":"18C"}],"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]}"#,
        ),
        (
            1,
            "chat-approx-lora",
            r#"{"model":"lora","messages":[{"role":"user","content":"SELECT * FROM t"}],"stream":true}"#,
        ),
        (
            1,
            "chat-image-uuids",
            r#"{"model":"qwen","messages":[{"role":"system","content":"Describe pictures."},{"role":"user","content":[{"type":"text","text":"Two:"},{"type":"image_url","image_url":{"url":"https://x/a.png"},"uuid":"img-a"},{"type":"image_url","image_url":{"url":"https://x/b.png"}}]}]}"#,
        ),
        (
            1,
            "chat-inline-png",
            r#"{"model":"vl","messages":[{"role":"user","content":[{"type":"text","text":"Sized:"},{"type":"image_url","image_url":{"url":"data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAEAAAAAwCAIAAAAAAAAA"}},{"type":"image_url","image_url":{"url":"data:image/jpeg;base64,/9j/"}}]}]}"#,
        ),
        // Lossless and extended (animated) WebP headers, the third cut short; a GIF, a top-down BMP.
        (
            1,
            "chat-inline-webp",
            r#"{"model":"vl","messages":[{"role":"user","content":[{"type":"text","text":"Sized:"},{"type":"image_url","image_url":{"url":"data:image/webp;base64,UklGRhIAAABXRUJQVlA4TAYAAAAvP8ALEAA="}},{"type":"image_url","image_url":{"url":"data:image/webp;base64,UklGRhYAAABXRUJQVlA4WAoAAAACAAAAYwAATwAA"}},{"type":"image_url","image_url":{"url":"data:image/webp;base64,UklGRhIAAABXRUJQVlA4TAYAAAAvPw=="}}]}]}"#,
        ),
        (
            1,
            "chat-inline-gif",
            r#"{"model":"vl","messages":[{"role":"user","content":[{"type":"text","text":"Sized:"},{"type":"image_url","image_url":{"url":"data:image/gif;base64,R0lGODlhQAAwAIAAAAAAAAAAACH5BAAKAAAALAAAAABAADAAAAICRAEAOw=="}},{"type":"image_url","image_url":{"url":"data:image/bmp;base64,Qk0AAAAAAAAAAAAAAAAoAAAAQAAAAND///8BABgAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"}}]}]}"#,
        ),
        (1, "chat-salted", r#"{"model":"qwen","messages":[{"role":"user","content":"x"}],"cache_salt":"s1"}"#),
        (2, "embeddings", r#"{"model":"approx","input":"embed me"}"#),
        (0, "no-model", r#"{"prompt":"x"}"#),
    ];
    for (sel, name, body) in bodies {
        let mut data = vec![*sel];
        data.extend_from_slice(body.as_bytes());
        write("ext_proc_body", name, &data)?;
    }

    // Chat requests: the five of the tokenizer fixture.
    let text = std::fs::read_to_string(root().join("tests/fixtures/tokenizer-qwen2.5/expected-chat.json"))?;
    let cases: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&text).map_err(std::io::Error::other)?;
    for (name, case) in &cases {
        let req = &case["request"];
        let mut chat = serde_json::json!({"messages": req["messages"]});
        if let Some(tools) = req.get("tools") {
            chat["tools"] = tools.clone();
        }
        write("chat_template", name, chat.to_string().as_bytes())?;
    }

    // KV events: every captured batch, as a SUB message (0) and as a replay reply (1, 2).
    for folder in ["v0.33", "legacy-array"] {
        for n in 0..5 {
            let dir = root().join("tests/fixtures/vllm-kv-events").join(folder);
            let seq = std::fs::read(dir.join(format!("batch-{n}.seq")))?;
            let payload = std::fs::read(dir.join(format!("batch-{n}.msgpack")))?;
            for sel in 0..3u8 {
                let mut data = vec![sel];
                data.extend_from_slice(&seq);
                data.extend_from_slice(&payload);
                write("kv_events", &format!("{folder}-{n}-{sel}"), &data)?;
            }
        }
    }

    // /metrics pages.
    for page in ["vllm-metrics-busy-lora.txt", "vllm-metrics-idle-nolora.txt"] {
        write("prometheus", page, &std::fs::read(root().join("tests/fixtures/vllm-metrics").join(page))?)?;
    }

    // An agent stream: Hello, snapshot, deltas (in order, a gap, a clear), an empty message.
    let info = PodInfo {
        pod: "engine-0".into(),
        endpoint: "10.0.0.1:8000".into(),
        model: "m".into(),
        block_size: 16,
        ..Default::default()
    };
    let stats = PodStats {
        num_requests_running: 3,
        num_requests_waiting: 1,
        kv_cache_usage: 0.4,
        health_score: 1.0,
        ready: true,
        ..Default::default()
    };
    let msgs = vec![
        agent_message::Msg::Hello(Hello {
            agent_id: "a-1".into(),
            node_name: "n".into(),
            protocol_version: 1,
            pods: vec![info.clone()],
        }),
        agent_message::Msg::Snapshot(PodSnapshot {
            info: Some(info),
            seq: 5,
            stats: Some(stats.clone()),
            blocks: vec![BlockRun { parent: 0, hashes: vec![11, 12, 13] }],
            offloaded_blocks: Vec::new(),
        }),
        agent_message::Msg::Delta(PodDelta {
            pod: "engine-0".into(),
            seq: 6,
            stats: Some(stats),
            blocks: Some(BlockChanges {
                cleared: false,
                stored: vec![BlockRun { parent: 13, hashes: vec![14] }],
                removed: vec![12],
            }),
            offloaded: None,
        }),
        agent_message::Msg::Delta(PodDelta {
            pod: "engine-0".into(),
            seq: 9,
            stats: None,
            blocks: Some(BlockChanges { cleared: true, ..Default::default() }),
            offloaded: None,
        }),
    ];
    let mut stream = Vec::new();
    for m in msgs {
        AgentMessage { msg: Some(m) }.encode_length_delimited(&mut stream).map_err(std::io::Error::other)?;
    }
    AgentMessage { msg: None }.encode_length_delimited(&mut stream).map_err(std::io::Error::other)?;
    write("agent_messages", "stream", &stream)?;

    // Config files: the shipped examples.
    write("agent_config", "example", &std::fs::read(root().join("agent/agent.example.yaml"))?)?;
    write("agent_config", "kubernetes", &std::fs::read(root().join("agent/agent.kubernetes.example.yaml"))?)?;
    // The one agent config deploy/ ships for every node (the per-node files it replaced remain
    // in the corpus as seeds of their own).
    write("agent_config", "deploy", &std::fs::read(root().join("deploy/k8s/base/agent/agent.yaml"))?)?;
    write("picker_config", "deploy", &std::fs::read(root().join("deploy/k8s/base/picker/picker.yaml"))?)?;
    let presets = "models:\n  - name: m\n    mode: approximate\n    approximate: {block_chars: 32, max_blocks: 8}\n\
                   scoring:\n  preset: multi-lora\n  max_queue: 5\n  custom: [{scorer: cost, weight: 0.0, margin: 0.2}]\n";
    write("picker_config", "presets", presets.as_bytes())?;

    // Cluster inputs: a pool file (0), an engine file (1), a vLLM pod as the API server sends it (2).
    let pool = "target_ports: [8000]\npods:\n  - name: vllm-0\n    ip: 127.0.0.1\n    ports: [8000, 8001]\n\
                    node: node-1\n    annotations: {kvroute.io/cost-per-hour: \"3.67\"}\n  - {name: vllm-1, ip: 10.0.0.2, ready: false}\n\
                models:\n  - name: chat\n    targets: [{model: base, adapter: my-lora, weight: 90}, {model: base, weight: 10}]\n\
                  - name: base\nobjectives: [{name: premium, priority: 10}]\n";
    write("cluster_inputs", "pool-file", &[b"\x00".as_slice(), pool.as_bytes()].concat())?;
    let engines = "engines:\n  - pod: vllm-0\n    endpoint: 127.0.0.1:8000\n    kv_events: tcp://127.0.0.1:5557\n\
                   kv_replay: tcp://127.0.0.1:5558\n    gpus: [0, GPU-0b2d]\n    model: Qwen/Qwen2.5-7B-Instruct\n\
                   max_num_seqs: 256\n    block_size: 16\n  - {pod: vllm-0, endpoint: 127.0.0.1:8001, rank: 1}\n";
    write("cluster_inputs", "engine-file", &[b"\x01".as_slice(), engines.as_bytes()].concat())?;
    let pod = serde_json::json!({
        "metadata": {"name": "vllm-0", "namespace": "inference", "uid": "u-1",
                     "annotations": {"kvroute.io/kv-replay-port": "5558"}},
        "spec": {"nodeName": "node-1", "containers": [{
            "name": "vllm", "image": "vllm/vllm-openai",
            "command": ["sh", "-c"],
            "args": ["vllm serve Qwen/Qwen2.5-7B-Instruct --port 8000 --data-parallel-size 2 --served-model-name qwen \
                      --kv-events-config '{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:$(KV_PORT)\",\"topic\":\"kv\"}'"],
            "env": [{"name": "KV_PORT", "value": "5557"}],
            "ports": [{"containerPort": 8000}, {"containerPort": 8001}]}]},
        "status": {"podIP": "10.0.0.11", "conditions": [{"type": "Ready", "status": "True"}]}
    });
    write("cluster_inputs", "vllm-pod", &[b"\x02".as_slice(), pod.to_string().as_bytes()].concat())?;

    // GIE EndpointPickerConfig files: the fixtures of GIE's and llm-d's charts, and the picker's
    // own config passed as --config-file.
    for f in ["default-plugins.yaml", "kvroute-plugin.yaml", "llm-d-precise-prefix.yaml", "pd-two-profiles.yaml"] {
        write("gie_config", f, &std::fs::read(root().join("tests/fixtures/gie").join(f))?)?;
    }
    write("gie_config", "picker-config", &std::fs::read(root().join("deploy/k8s/base/picker/picker.yaml"))?)?;

    agent_token_seeds()?;
    kube_object_seeds()?;
    replica_message_seeds()?;
    response_usage_seeds()?;

    // Inline images: the image fixtures as bytes (0) and one as a data URL (1).
    for entry in std::fs::read_dir(root().join("tests/fixtures/images"))? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("image").to_string();
        write("image_headers", &name, &[b"\x00".as_slice(), &std::fs::read(&path)?].concat())?;
    }
    let gif = "data:image/gif;base64,R0lGODlhQAAwAIAAAAAAAAAAACH5BAAKAAAALAAAAABAADAAAAICRAEAOw==";
    write("image_headers", "data-url-gif", &[b"\x01".as_slice(), gif.as_bytes()].concat())?;
    Ok(())
}

/// Agent tokens: byte 0 = the pod the API reads, then `authorization` value, newline, TokenReview.
fn agent_token_seeds() -> std::io::Result<()> {
    let exp = serde_json::json!({"aud": ["kvroute-picker"], "exp": 4_102_444_800u64, "sub": "system:serviceaccount:kvroute-system:kvroute-agent"});
    let b64 = |v: &serde_json::Value| kvroute_fuzz_targets::base64_url(v.to_string().as_bytes());
    let token = format!("{}.{}.c2lnbmF0dXJl", b64(&serde_json::json!({"alg": "RS256"})), b64(&exp));
    let review = |extra: serde_json::Value, authenticated: bool| {
        serde_json::json!({
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
            "spec": {"token": "", "audiences": ["kvroute-picker"]},
            "status": {"authenticated": authenticated, "audiences": ["kvroute-picker"],
                       "user": {"username": "system:serviceaccount:kvroute-system:kvroute-agent",
                                "uid": "sa-uid", "groups": ["system:serviceaccounts"], "extra": extra}}
        })
    };
    let bound = serde_json::json!({
        "authentication.kubernetes.io/pod-name": ["kvroute-agent-x7k2p"],
        "authentication.kubernetes.io/pod-uid": ["0b5c6f1e-3a59-4f63-9d0e-8c1d2e3f4a5b"],
        "authentication.kubernetes.io/node-name": ["node-a"]
    });
    let no_node = serde_json::json!({
        "authentication.kubernetes.io/pod-name": ["kvroute-agent-x7k2p"],
        "authentication.kubernetes.io/pod-uid": ["0b5c6f1e-3a59-4f63-9d0e-8c1d2e3f4a5b"]
    });
    let seed = |sel: u8, header: &str, review: &serde_json::Value| {
        [vec![sel], header.as_bytes().to_vec(), b"\n".to_vec(), review.to_string().into_bytes()].concat()
    };
    write("agent_token", "node-claim", &seed(0, &format!("Bearer {token}"), &review(bound, true)))?;
    write("agent_token", "pod-read", &seed(1, &format!("bearer {token}"), &review(no_node.clone(), true)))?;
    let no_node_clear = no_node.clone();
    write("agent_token", "pod-other-uid", &seed(2, &format!("Bearer {token}"), &review(no_node, true)))?;
    let refused = serde_json::json!({"spec": {}, "status": {"authenticated": false, "error": "token expired"}});
    write("agent_token", "refused", &seed(0, "Bearer abc.def.ghi", &refused))?;
    let clear = format!("Bearer {}.{exp}.c2lnbmF0dXJl", b64(&serde_json::json!({"alg": "RS256"})));
    write("agent_token", "clear-claims", &seed(4 | 1, &clear, &review(no_node_clear, true)))?;
    Ok(())
}

/// Kubernetes objects: byte 0 = 0 InferencePool, 1 EndpointSlices (| 4: the `ingest` port), 2
/// model objects, 3 a PodResources `List` answer.
fn kube_object_seeds() -> std::io::Result<()> {
    let pool = serde_json::json!({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "vllm-qwen2-5-7b", "namespace": "inference", "uid": "p-1"},
        "spec": {"selector": {"matchLabels": {"app": "vllm-qwen2-5-7b"}},
                 "targetPorts": [{"number": 8000}, {"number": 8001}], "appProtocol": "http",
                 "endpointPickerRef": {"kind": "Service", "name": "kvroute-picker", "port": {"number": 9002},
                                       "failureMode": "FailClose"}},
        "status": {"parents": [{"parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw"},
                                "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted",
                                                "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}]}
    });
    write("kube_objects", "inferencepool", &[b"\x00".as_slice(), pool.to_string().as_bytes()].concat())?;
    let slice = |name: &str, ips: &[&str]| {
        serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": "kvroute-system",
                         "labels": {"kubernetes.io/service-name": "kvroute-picker"}},
            "ports": [{"name": "ingest", "port": 9010, "protocol": "TCP"}, {"name": "ext-proc", "port": 9002}],
            "endpoints": ips.iter().enumerate().map(|(i, ip)| serde_json::json!({
                "addresses": [ip], "nodeName": format!("node-{i}"),
                "conditions": {"ready": i == 0, "serving": true, "terminating": i == 2},
                "targetRef": {"kind": "Pod", "name": format!("kvroute-picker-{i}"), "namespace": "kvroute-system"}
            })).collect::<Vec<_>>()
        })
    };
    let slices = serde_json::json!([slice("a", &["10.0.0.5", "10.0.0.6", "10.0.0.7"]), slice("b", &["fd00::5"])]);
    write("kube_objects", "endpointslices", &[b"\x05".as_slice(), slices.to_string().as_bytes()].concat())?;
    let models = serde_json::json!([
        {"apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceModelRewrite",
         "metadata": {"name": "chat-split", "namespace": "inference", "creationTimestamp": "2026-01-01T00:00:00Z"},
         "spec": {"poolRef": {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "pool"},
                  "rules": [{"matches": [{"model": {"type": "Exact", "value": "chat"}}],
                             "targets": [{"modelRewrite": "base", "weight": 90}, {"modelRewrite": "sql-lora", "weight": 10}]},
                            {"targets": [{"modelRewrite": "base"}]}]}},
        {"apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceObjective",
         "metadata": {"name": "premium", "namespace": "inference"},
         "spec": {"poolRef": {"name": "pool"}, "priority": 10}}
    ]);
    write("kube_objects", "model-objects", &[b"\x02".as_slice(), models.to_string().as_bytes()].concat())?;
    use kvroute_cluster::podresources::proto::{
        ContainerDevices, ContainerResources, ListPodResourcesResponse, PodResources,
    };
    let list = ListPodResourcesResponse {
        pod_resources: vec![PodResources {
            name: "vllm-0".into(),
            namespace: "inference".into(),
            containers: vec![ContainerResources {
                name: "vllm".into(),
                devices: vec![
                    ContainerDevices {
                        resource_name: "nvidia.com/gpu".into(),
                        device_ids: vec!["GPU-0b2d".into(), "GPU-77aa".into()],
                        ..Default::default()
                    },
                    ContainerDevices {
                        resource_name: "nvidia.com/mig-1g.10gb".into(),
                        device_ids: vec!["MIG-1".into()],
                        ..Default::default()
                    },
                ],
                ..Default::default()
            }],
            ..Default::default()
        }],
    };
    write("kube_objects", "podresources", &[b"\x03".as_slice(), &list.encode_to_vec()].concat())?;
    Ok(())
}

/// A peer replica's stream: Hello, two requests routed (one to a pod not in the pool), one
/// finished, a pod unreachable, an empty message.
fn replica_message_seeds() -> std::io::Result<()> {
    use kvroute_proto::replica::v1::{Finished, Hello, ReplicaMessage, Routed, Unreachable, replica_message::Msg};
    let msgs = [
        Some(Msg::Hello(Hello { replica_id: "r-1".into(), protocol_version: 1 })),
        Some(Msg::Routed(Routed {
            id: 1,
            pod: "pod-0".into(),
            routed_unix_ms: 1_800_000_000_000,
            blocks: vec![1, 2, 3],
        })),
        Some(Msg::Routed(Routed {
            id: 2,
            pod: "elsewhere".into(),
            routed_unix_ms: 1_799_999_999_000,
            blocks: vec![4],
        })),
        Some(Msg::Routed(Routed { id: 0, pod: "pod-1".into(), routed_unix_ms: 0, blocks: vec![1, 2] })),
        Some(Msg::Finished(Finished { id: 1, pod: "pod-0".into() })),
        Some(Msg::Unreachable(Unreachable { pod: "pod-2".into() })),
        None,
    ];
    let mut stream = Vec::new();
    for msg in msgs {
        ReplicaMessage { msg }.encode_length_delimited(&mut stream).map_err(std::io::Error::other)?;
    }
    write("replica_messages", "stream", &stream)
}

/// Engine responses: byte 0 = content-type (0 unknown, 1 JSON, 2 event stream) | (chunk - 1) << 2.
fn response_usage_seeds() -> std::io::Result<()> {
    let json = r#"{"id":"cmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":40,"total_tokens":42,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":32}}}"#;
    write("response_usage", "json", &[&[1 | (6 << 2)][..], json.as_bytes()].concat())?;
    let sse = concat!(
        r#"data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hi"}}],"usage":null}"#,
        "\n\n",
        r#"data: {"id":"c","choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":16}}}"#,
        "\n\ndata: [DONE]\n\n"
    );
    write("response_usage", "sse", &[&[2 | (2 << 2)][..], sse.as_bytes()].concat())?;
    write("response_usage", "sniffed", &[&[0][..], sse.as_bytes()].concat())?;
    Ok(())
}
