//! A whole kvroute fleet on one machine: N emulated engines, agents (each watching a share of the
//! engines, GPUs from a mock-NVML scenario), the picker and Envoy with `deploy/envoy/envoy.yaml`.
//! Optionally a second Envoy doing plain round robin (`deploy/envoy/envoy-round-robin.yaml`) over
//! the same engines, as the baseline the demo compares against, a third doing least-request
//! (`deploy/envoy/envoy-least-request.yaml`), the least-loaded baseline, and further Envoys on
//! other kvroute configs sharing the same picker (to compare ext_proc layouts in one run).

use crate::client::GatewayClient;
use crate::paths::{self, free_port};
use crate::process::ManagedProcess;
use crate::tls;
use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// The base model the demo fleet's engines serve (the Qwen2.5 fixture tokenizer's family).
pub const DEFAULT_MODEL: &str = "Qwen/Qwen2.5-7B-Instruct";

/// Which engine each pod runs.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum EngineKind {
    /// `kvroute-emulator`: fast, GPU-only behaviour (faults, timing scale, images).
    #[default]
    Emulator,
    /// vLLM's CPU build (`scripts/install-vllm`) on the random-weight model, one core each.
    Vllm(VllmSpec),
}

/// How the real vLLM engines are started (docs/operations.md, "Real vLLM").
#[derive(Clone, Debug, PartialEq)]
pub struct VllmSpec {
    /// `--block-size` (vLLM's CPU attention needs a multiple of 32).
    pub block_size: u32,
    /// `--num-gpu-blocks-override`: KV capacity in engine blocks; `None`: from the KV space.
    pub num_gpu_blocks: Option<u32>,
    /// `VLLM_CPU_KVCACHE_SPACE`, whole GiB.
    pub kv_cache_gib: u32,
    /// LoRA adapters served with `--enable-lora` (`adapter-1` … as built by
    /// `scripts/make-vllm-model`); 0 = LoRA off.
    pub lora_adapters: usize,
    /// `--max-model-len`.
    pub max_model_len: u32,
}

impl Default for VllmSpec {
    fn default() -> Self {
        Self { block_size: 32, num_gpu_blocks: None, kv_cache_gib: 1, lora_adapters: 0, max_model_len: 4096 }
    }
}

/// Longest a real vLLM engine may take from start to `/health` 200 (about 75-100 s on 2 cores,
/// more when several start at once).
const VLLM_READY_TIMEOUT: Duration = Duration::from_secs(420);

/// What to start. `Default` is the demo's fleet: 4 engines, 2 agents, healthy GPUs.
#[derive(Clone, Debug)]
pub struct FleetSpec {
    /// The engines' kind; the rest of the fleet is the same for both.
    pub engine_kind: EngineKind,
    /// Names the work directory `target/kvroute-runs/<label>`.
    pub label: String,
    /// Served base model id (the block-hash root's model).
    pub model: String,
    pub engines: usize,
    pub engines_per_agent: usize,
    /// Mock-NVML scenario per agent, file names under `agent/scenarios/`; missing → `healthy.yaml`.
    pub agent_scenarios: Vec<String>,
    /// Emulator timing: multiplies every simulated duration (0.1 = ten times faster than real).
    pub time_scale: f64,
    pub prefill_us_per_token: u32,
    pub decode_ms_per_token: u32,
    /// KV capacity of each emulated engine, in `emulator_block_size`-token blocks (vLLM's
    /// `num_gpu_blocks`: one of them is the null block).
    pub num_gpu_blocks: u32,
    /// Tokens per block of the emulated engines (`--block-size`; vLLM's is in [`VllmSpec`]).
    /// Default 16.
    pub emulator_block_size: u32,
    pub max_num_seqs: u32,
    /// Prefills each engine runs at once (emulator `--max-num-partial-prefills`); 0 = no limit.
    pub max_num_partial_prefills: u32,
    /// Agent stats report interval (ms).
    pub report_interval_ms: u64,
    /// Also start the round-robin baseline gateway.
    pub round_robin_baseline: bool,
    /// Also start the least-request baseline gateway.
    pub least_request_baseline: bool,
    /// Picker log level.
    pub picker_log_level: String,
    /// Start the picker without a tokenizer for the model, in approximate mode (docs/design.md §6: text
    /// blocks matched against where earlier requests went; the KV-event index is not consulted).
    pub picker_approximate: bool,
    /// More Envoy + picker gateways, one per config file (paths relative to the workspace root,
    /// e.g. `deploy/envoy/envoy-full-duplex.yaml`), each pointed at the same picker with its ports
    /// rewritten like `deploy/envoy/envoy.yaml`'s.
    pub extra_gateway_configs: Vec<PathBuf>,
    /// Also start an Envoy with the picker's config whose ext_proc server is
    /// `kvroute-noop-ext-proc` (the picker's reply shapes, a fixed destination: the first engine),
    /// the floor under the picker's added latency.
    pub noop_ext_proc_gateway: bool,
    /// Picker replicas (each with its own ports, the same pool file; every agent streams to all
    /// of them, Envoy's picker cluster lists all of them; with more than one, each lists the
    /// others as `replicas.peers`, as deploy/ joins them, unless `picker_overrides` sets
    /// `replicas`). Default 1.
    pub picker_replicas: usize,
    /// Top-level keys set in every picker replica's config file, e.g.
    /// `{"limits": {"max_report_age_ms": 1500}, "shutdown_drain_ms": 1000}`.
    pub picker_overrides: Option<Value>,
    /// Placeholder tokens per image: the engines' `--mm-tokens-per-image` and the picker's
    /// `image_tokens` for the model (docs/design.md §2). `None`: the emulator's default (256) and
    /// no `image_tokens` (the picker claims no block from an image on).
    pub image_tokens: Option<usize>,
    /// Inline images count as the Qwen2-VL processor sizes them: the engines' `--mm-vision` and
    /// the picker's `vision: {}` (docs/design.md §2); URL images keep `image_tokens` on the
    /// engines. Default false.
    pub image_vision: bool,
    /// Every kvroute Envoy (picker, extra and no-op gateways) writes an access log line per
    /// request with its ext_proc filter's latency per phase ([`Fleet::ext_proc_phase_log`]).
    pub ext_proc_phase_log: bool,
}

impl Default for FleetSpec {
    fn default() -> Self {
        Self {
            engine_kind: EngineKind::Emulator,
            label: "fleet".into(),
            model: DEFAULT_MODEL.into(),
            engines: 4,
            engines_per_agent: 2,
            agent_scenarios: Vec::new(),
            time_scale: 1.0,
            prefill_us_per_token: 220,
            decode_ms_per_token: 20,
            num_gpu_blocks: 4096,
            emulator_block_size: 16,
            max_num_seqs: 8,
            max_num_partial_prefills: 0,
            report_interval_ms: 500,
            round_robin_baseline: false,
            least_request_baseline: false,
            picker_log_level: "info".into(),
            picker_approximate: false,
            extra_gateway_configs: Vec::new(),
            noop_ext_proc_gateway: false,
            picker_replicas: 1,
            picker_overrides: None,
            image_tokens: None,
            image_vision: false,
            ext_proc_phase_log: false,
        }
    }
}

/// The name of a pod's only engine: `<pod>-rank-0`.
fn endpoint_name(pod: &str) -> String {
    format!("{pod}-rank-0")
}

/// One emulated engine (a vLLM pod stand-in).
pub struct Engine {
    /// Pod name (`engine-<i>`).
    pub pod: String,
    pub port: u16,
    pub kv_events_port: u16,
    pub kv_replay_port: u16,
    process: Option<ManagedProcess>,
}

impl Engine {
    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
    /// `127.0.0.1:<port>`, the endpoint the picker hands to Envoy.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
    /// `<pod>-rank-0`: the engine's name at the picker (its metrics, `/explain`) and the agent,
    /// as the GIE endpoint picker names a pod's target port (docs/design.md §14), and the
    /// emulator's `x-served-by`.
    pub fn name(&self) -> String {
        endpoint_name(&self.pod)
    }
    /// Whether the engine process is still owned (not killed by the test).
    pub fn is_running(&self) -> bool {
        self.process.is_some()
    }

    /// Starts one engine of `spec`'s kind alone, on fresh ports, as pod `pod` (`i` picks a
    /// vLLM engine's core): no agent, picker or gateway, for tests that drive an engine directly.
    /// Returns once it serves; its logs go to `work`. Dropping it kills it.
    pub async fn start_alone(spec: &FleetSpec, pod: &str, i: usize, work: &Path) -> Result<Engine> {
        let (port, kv_events_port, kv_replay_port) = (free_port()?, free_port()?, free_port()?);
        let mut engine = Engine { pod: pod.to_owned(), port, kv_events_port, kv_replay_port, process: None };
        engine.process = Some(start_engine(spec, &engine, i, pod, work).await?);
        Ok(engine)
    }

    /// The same pod and ports, without the process.
    fn clone_ports(&self) -> Engine {
        Engine { pod: self.pod.clone(), process: None, ..*self }
    }
}

/// Starts `engine`'s process (index `i` in the fleet) under the name `name` and waits until it
/// serves: the emulator prints READY; vLLM answers `GET /health` with 200.
async fn start_engine(spec: &FleetSpec, engine: &Engine, i: usize, name: &str, work: &Path) -> Result<ManagedProcess> {
    match &spec.engine_kind {
        EngineKind::Emulator => {
            let args = emulator_args(spec, &engine.name(), engine.port, engine.kv_events_port, engine.kv_replay_port);
            ManagedProcess::spawn(name, &paths::binary("kvroute-emulator")?, &args, work, "READY", READY_TIMEOUT).await
        }
        EngineKind::Vllm(v) => {
            let (args, env) = vllm_command(spec, v, engine, i)?;
            let mut p = ManagedProcess::start_group(name, &paths::vllm()?, &args, &env, work)?;
            wait_http_ok(&format!("{}/health", engine.url()), &mut p, VLLM_READY_TIMEOUT).await?;
            Ok(p)
        }
    }
}

/// A command's arguments and extra environment variables.
type CommandLine = (Vec<String>, Vec<(String, String)>);

/// `vllm serve` arguments and environment for `engine` (docs/operations.md, "Real vLLM"): the
/// random-weight model under the fleet's model name, prefix caching, usage with cached tokens,
/// KV events on ZeroMQ (publisher and replay), tools, LoRA when asked, one core per engine.
fn vllm_command(spec: &FleetSpec, v: &VllmSpec, e: &Engine, i: usize) -> Result<CommandLine> {
    let model_dir = paths::vllm_model()?;
    let kv_events = json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        // vLLM binds only a wildcard endpoint (`tcp://*:P`); it connects to any other.
        "endpoint": format!("tcp://*:{}", e.kv_events_port),
        "replay_endpoint": format!("tcp://127.0.0.1:{}", e.kv_replay_port),
        "topic": format!("kv@127.0.0.1@{}", spec.model),
    });
    let mut args: Vec<String> = vec!["serve".into(), path_arg(&model_dir)];
    let mut flag = |k: &str, val: String| {
        args.push(k.into());
        args.push(val);
    };
    flag("--served-model-name", spec.model.clone());
    flag("--host", "127.0.0.1".into());
    flag("--port", e.port.to_string());
    flag("--block-size", v.block_size.to_string());
    flag("--max-model-len", v.max_model_len.to_string());
    flag("--max-num-seqs", spec.max_num_seqs.to_string());
    flag("--kv-events-config", kv_events.to_string());
    flag("--tool-call-parser", "hermes".into());
    flag("--seed", "0".into());
    if let Some(n) = v.num_gpu_blocks {
        flag("--num-gpu-blocks-override", n.to_string());
    }
    if v.lora_adapters > 0 {
        let modules: Vec<String> = (1..=v.lora_adapters)
            .map(|k| format!("adapter-{k}={}", model_dir.join("loras").join(format!("adapter-{k}")).display()))
            .collect();
        flag("--max-lora-rank", "8".into());
        flag("--max-loras", v.lora_adapters.to_string());
        args.push("--enable-lora".into());
        args.push("--lora-modules".into());
        args.extend(modules);
    }
    args.extend(
        ["--enable-prefix-caching", "--enable-prompt-tokens-details", "--enable-auto-tool-choice"].map(String::from),
    );
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let env = [
        ("VLLM_TARGET_DEVICE", "cpu".to_owned()),
        ("VLLM_CPU_KVCACHE_SPACE", v.kv_cache_gib.to_string()),
        ("VLLM_CPU_OMP_THREADS_BIND", (i % cores).to_string()),
        ("OMP_NUM_THREADS", "1".to_owned()),
        // POST /reset_prefix_cache, which the fleet uses between compared runs.
        ("VLLM_SERVER_DEV_MODE", "1".to_owned()),
        ("HF_HUB_OFFLINE", "1".to_owned()),
        ("VLLM_NO_USAGE_STATS", "1".to_owned()),
        ("DO_NOT_TRACK", "1".to_owned()),
    ]
    .map(|(k, v)| (k.to_owned(), v))
    .to_vec();
    Ok((args, env))
}

/// Polls `url` until it answers 200; fails with the log tail when `p` exits first or `timeout`
/// passes.
async fn wait_http_ok(url: &str, p: &mut ManagedProcess, timeout: Duration) -> Result<()> {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).build()?;
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(r) = http.get(url).send().await
            && r.status().is_success()
        {
            return Ok(());
        }
        if p.has_exited() {
            bail!("{} exited before {url} answered; last log lines:\n{}", p.name, p.log_tail(30));
        }
        if Instant::now() > deadline {
            bail!("{} did not answer {url} within {timeout:?}; last log lines:\n{}", p.name, p.log_tail(30));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A running fleet; dropping it kills every process.
pub struct Fleet {
    pub spec: FleetSpec,
    pub work: PathBuf,
    pub engines: Vec<Engine>,
    /// `http://127.0.0.1:<port>` of the kvroute gateway (Envoy + picker).
    pub gateway: String,
    /// `http://127.0.0.1:<port>` of the round-robin baseline gateway, if started.
    pub round_robin_gateway: Option<String>,
    /// `http://127.0.0.1:<port>` of each of `spec.extra_gateway_configs`' gateways, in order.
    pub extra_gateways: Vec<String>,
    /// `http://127.0.0.1:<port>` of the least-request baseline gateway, if started.
    pub least_request_gateway: Option<String>,
    /// `http://127.0.0.1:<port>` of the Envoy + no-op ext_proc gateway, if started.
    pub noop_gateway: Option<String>,
    /// `http://127.0.0.1:<port>` of the (first) picker's admin server (/metrics).
    pub picker_admin: String,
    /// The admin server of every picker replica, in order (`picker_admins[0] == picker_admin`).
    pub picker_admins: Vec<String>,
    /// `http://127.0.0.1:<port>` of each agent's own `/metrics`, in agent order.
    pub agent_admins: Vec<String>,
    agents: Vec<ManagedProcess>,
    agent_args: Vec<Vec<String>>,
    /// Per replica: its command-line arguments.
    picker_args: Vec<Vec<String>>,
    /// Per replica; `None` while stopped by the test.
    pickers: Vec<Option<ManagedProcess>>,
    envoys: Vec<ManagedProcess>,
    noop_ext_proc: Option<ManagedProcess>,
    http: reqwest::Client,
}

impl Fleet {
    /// Starts engines, picker, agents and Envoy, and waits until the picker knows every pod.
    pub async fn start(spec: FleetSpec) -> Result<Fleet> {
        let work = paths::work_dir(&spec.label)?;
        let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?;

        let mut engines = Vec::new();
        let mut starting = Vec::new();
        for i in 0..spec.engines {
            let (port, kv_events_port, kv_replay_port) = (free_port()?, free_port()?, free_port()?);
            let engine = Engine { pod: format!("engine-{i}"), port, kv_events_port, kv_replay_port, process: None };
            let (spec, work, name, ready) = (spec.clone(), work.clone(), engine.pod.clone(), engine.clone_ports());
            starting.push(tokio::spawn(async move { start_engine(&spec, &ready, i, &name, &work).await }));
            engines.push(engine);
        }
        for (engine, task) in engines.iter_mut().zip(starting) {
            engine.process = Some(task.await.context("engine start task")??);
        }

        // mTLS between agents and picker, as deployed (docs/design.md §14): a CA made now, the
        // picker's certificate and one per node.
        let pki = work.join("tls");
        let ca = tls::TestCa::new("kvroute fleet CA")?;
        let ca_file = pki.join("ca.crt");
        std::fs::create_dir_all(&pki)?;
        std::fs::write(&ca_file, ca.cert_pem())?;
        let picker_tls = tls::write(&pki, "picker", &ca.picker()?)?;

        // File mode (docs/design.md §14): the pool file is the picker's only source of endpoints.
        write_yaml(
            &work.join(POOL_FILE),
            &pool_file(spec.engines_per_agent, engines.iter().enumerate().map(|(i, e)| (i, e, true))),
        )?;
        let (mut pickers, mut picker_args) = (Vec::new(), Vec::new());
        let replicas = spec.picker_replicas.max(1);
        let ports: Vec<(u16, u16, u16)> =
            (0..replicas).map(|_| Ok((free_port()?, free_port()?, free_port()?))).collect::<Result<_>>()?;
        let ext_proc_ports: Vec<u16> = ports.iter().map(|p| p.0).collect();
        let ingest_ports: Vec<u16> = ports.iter().map(|p| p.1).collect();
        let picker_admins: Vec<String> = ports.iter().map(|p| format!("http://127.0.0.1:{}", p.2)).collect();
        for (r, &(ext_proc_port, ingest_port, admin_port)) in ports.iter().enumerate() {
            let picker_cfg = work.join(if r == 0 { "picker.yaml".to_owned() } else { format!("picker-{r}.yaml") });
            let mut picker_yaml = picker_config(&spec, ext_proc_port, ingest_port, admin_port);
            picker_yaml["ingest_tls"] = json!({
                "ca_file": path_arg(&ca_file), "cert_file": path_arg(&picker_tls.cert), "key_file": path_arg(&picker_tls.key),
            });
            if replicas > 1 {
                // One view across replicas, as deploy/ runs them (docs/design.md §4): each
                // replica subscribes to the others' ReplicaSync on their ingest listeners.
                let peers: Vec<String> =
                    ingest_ports.iter().filter(|&&p| p != ingest_port).map(|p| format!("127.0.0.1:{p}")).collect();
                picker_yaml["replicas"] = json!({ "peers": peers });
            }
            if let Some(Value::Object(overrides)) = &spec.picker_overrides {
                for (k, v) in overrides {
                    picker_yaml[k] = v.clone();
                }
            }
            write_yaml(&picker_cfg, &picker_yaml)?;
            let args =
                vec!["--config".into(), path_arg(&picker_cfg), "--log-level".into(), spec.picker_log_level.clone()];
            let name = if r == 0 { "picker".to_owned() } else { format!("picker-{r}") };
            let bin = paths::binary("kvroute-picker")?;
            pickers.push(Some(ManagedProcess::spawn(&name, &bin, &args, &work, "READY", READY_TIMEOUT).await?));
            picker_args.push(args);
        }

        let mut agents = Vec::new();
        let mut agent_args = Vec::new();
        let mut agent_admins = Vec::new();
        for (a, chunk) in engines.chunks(spec.engines_per_agent.max(1)).enumerate() {
            let cfg_path = work.join(format!("agent-{a}.yaml"));
            let metrics_port = free_port()?;
            agent_admins.push(format!("http://127.0.0.1:{metrics_port}"));
            let mut agent_yaml = agent_config(&spec, a, chunk, &ingest_ports, metrics_port);
            let node_tls = tls::write(&pki, &format!("node-{a}"), &ca.agent(&format!("node-{a}"))?)?;
            agent_yaml["picker_tls"] = json!({
                "ca_file": path_arg(&ca_file), "cert_file": path_arg(&node_tls.cert), "key_file": path_arg(&node_tls.key),
            });
            write_yaml(&cfg_path, &agent_yaml)?;
            let scenario = spec.agent_scenarios.get(a).cloned().unwrap_or_else(|| "healthy.yaml".into());
            let scenario_path = paths::repo_root().join("agent/scenarios").join(scenario);
            let args = vec![
                "--config".into(),
                path_arg(&cfg_path),
                "--gpu-source".into(),
                format!("mock:{}", scenario_path.display()),
            ];
            let name = format!("agent-{a}");
            agents.push(
                ManagedProcess::spawn(&name, &paths::binary("kvroute-agent")?, &args, &work, "READY", READY_TIMEOUT)
                    .await?,
            );
            agent_args.push(args);
        }

        let envoy_bin = paths::envoy()?;
        let gateway_port = free_port()?;
        let main = KvrouteEnvoy::Picker.name();
        let envoy_cfg = work.join(format!("{main}.yaml"));
        let deploy_cfg = paths::repo_root().join("deploy/envoy/envoy.yaml");
        let phase_log = |name: &str| spec.ext_proc_phase_log.then(|| phase_log_path(&work, name));
        write_yaml(
            &envoy_cfg,
            &kvroute_envoy_config(&deploy_cfg, gateway_port, free_port()?, &ext_proc_ports, phase_log(&main))?,
        )?;
        let mut envoys = vec![start_envoy(&main, &envoy_bin, &envoy_cfg, &work)?];
        let mut admin_urls = vec![admin_url_of(&envoy_cfg)?];
        let mut extra_gateways = Vec::new();
        for (i, path) in spec.extra_gateway_configs.iter().enumerate() {
            let port = free_port()?;
            let name = KvrouteEnvoy::Extra(i).name();
            let cfg = work.join(format!("{name}.yaml"));
            let log = phase_log(&name);
            let mut extra =
                kvroute_envoy_config(&paths::repo_root().join(path), port, free_port()?, &ext_proc_ports, log)?;
            list_engines(&mut extra, &engines)?;
            write_yaml(&cfg, &extra)?;
            envoys.push(start_envoy(&name, &envoy_bin, &cfg, &work)?);
            admin_urls.push(admin_url_of(&cfg)?);
            extra_gateways.push(format!("http://127.0.0.1:{port}"));
        }
        let (mut noop_gateway, mut noop_ext_proc) = (None, None);
        if spec.noop_ext_proc_gateway {
            let (port, noop_port) = (free_port()?, free_port()?);
            let endpoint = engines.first().map(Engine::endpoint).context("the no-op ext_proc needs an engine")?;
            let args = vec!["--listen".into(), format!("127.0.0.1:{noop_port}"), "--endpoint".into(), endpoint];
            let bin = paths::binary("kvroute-noop-ext-proc")?;
            noop_ext_proc =
                Some(ManagedProcess::spawn("noop-ext-proc", &bin, &args, &work, "READY", READY_TIMEOUT).await?);
            let name = KvrouteEnvoy::NoOp.name();
            let cfg = work.join(format!("{name}.yaml"));
            let log = phase_log(&name);
            write_yaml(&cfg, &kvroute_envoy_config(&deploy_cfg, port, free_port()?, &[noop_port], log)?)?;
            envoys.push(start_envoy(&name, &envoy_bin, &cfg, &work)?);
            admin_urls.push(admin_url_of(&cfg)?);
            noop_gateway = Some(format!("http://127.0.0.1:{port}"));
        }
        let mut baseline_gateways = [None, None];
        let baselines = [
            (spec.round_robin_baseline, "envoy-round-robin", "pods_round_robin"),
            (spec.least_request_baseline, "envoy-least-request", "pods_least_request"),
        ];
        for ((wanted, name, cluster), gateway) in baselines.into_iter().zip(&mut baseline_gateways) {
            if !wanted {
                continue;
            }
            let port = free_port()?;
            let cfg = work.join(format!("{name}.yaml"));
            write_yaml(&cfg, &baseline_envoy_config(name, cluster, port, free_port()?, &engines)?)?;
            envoys.push(start_envoy(name, &envoy_bin, &cfg, &work)?);
            admin_urls.push(admin_url_of(&cfg)?);
            *gateway = Some(format!("http://127.0.0.1:{port}"));
        }
        let [round_robin_gateway, least_request_gateway] = baseline_gateways;
        for (admin, proc) in admin_urls.iter().zip(&envoys) {
            wait_envoy_ready(&http, admin, proc).await?;
        }

        let fleet = Fleet {
            spec,
            work,
            engines,
            gateway: format!("http://127.0.0.1:{gateway_port}"),
            round_robin_gateway,
            extra_gateways,
            least_request_gateway,
            noop_gateway,
            picker_admin: picker_admins[0].clone(),
            picker_admins,
            agent_admins,
            agents,
            agent_args,
            picker_args,
            pickers,
            envoys,
            noop_ext_proc,
            http,
        };
        let pods: Vec<String> = fleet.engines.iter().map(Engine::name).collect();
        fleet.wait_for_pods(&pods, Duration::from_secs(30)).await?;
        Ok(fleet)
    }

    /// A client for `base` (one of the fleet's gateways) that names the pod serving each request
    /// also when the engine does not say (real vLLM), from the upstream address Envoy reports.
    pub fn client(&self, base: &str) -> Result<GatewayClient> {
        let names = self.engines.iter().map(|e| (e.endpoint(), e.name())).collect();
        Ok(GatewayClient::new(base)?.with_endpoint_names(names))
    }

    /// The picker's Prometheus text.
    pub async fn picker_metrics(&self) -> Result<String> {
        let r = self.http.get(format!("{}/metrics", self.picker_admin)).send().await?;
        Ok(r.error_for_status()?.text().await?)
    }

    /// A gauge of the picker's metrics for one pod (`name{model_server_pod="<pod>"}`), if exported.
    pub async fn pod_gauge(&self, name: &str, pod: &str) -> Result<Option<f64>> {
        let text = self.picker_metrics().await?;
        Ok(metric_value(&text, name, &format!("model_server_pod=\"{pod}\"")))
    }

    /// Waits until the picker reports a health score for every named pod.
    pub async fn wait_for_pods(&self, pods: &[String], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let text = self.picker_metrics().await.unwrap_or_default();
            let missing: Vec<&String> = pods
                .iter()
                .filter(|p| metric_value(&text, "epp_pod_health_score", &format!("model_server_pod=\"{p}\"")).is_none())
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "picker did not learn pods {missing:?} within {timeout:?}; picker log:\n{}\nagent log:\n{}",
                    self.picker_log_tail(20),
                    self.agents.first().map(|a| a.log_tail(20)).unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Polls until `pred(value)` holds for the picker gauge `name{pod}`; returns the last value.
    pub async fn wait_pod_gauge(
        &self,
        name: &str,
        pod: &str,
        timeout: Duration,
        pred: impl Fn(f64) -> bool,
    ) -> Result<f64> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(v) = self.pod_gauge(name, pod).await? {
                if pred(v) {
                    return Ok(v);
                }
                if Instant::now() > deadline {
                    bail!("{name}{{model_server_pod={pod}}} = {v} did not reach the expected value within {timeout:?}");
                }
            } else if Instant::now() > deadline {
                bail!("{name}{{model_server_pod={pod}}} not exported within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Kills engine `i` (the process, as a crash would).
    pub async fn kill_engine(&mut self, i: usize) {
        if let Some(mut p) = self.engines.get_mut(i).and_then(|e| e.process.take()) {
            p.kill().await;
        }
    }

    /// Restarts engine `i` on the same ports (killing it first if it runs): a fresh engine with an
    /// empty cache whose KV-event sequence starts again at 0, as after a crash and pod restart.
    pub async fn restart_engine(&mut self, i: usize) -> Result<()> {
        self.kill_engine(i).await;
        let e = self.engines.get(i).context("no such engine")?;
        let name = format!("{}-restarted", e.pod);
        let p = start_engine(&self.spec, &e.clone_ports(), i, &name, &self.work).await?;
        if let Some(e) = self.engines.get_mut(i) {
            e.process = Some(p);
        }
        Ok(())
    }

    /// Rewrites the picker's pool file: the engines `(index, ready)` listed are the pool's pods,
    /// the others leave it. The picker follows within its poll period (500 ms), without a restart.
    pub fn set_pool(&self, members: &[(usize, bool)]) -> Result<()> {
        let listed = members.iter().filter_map(|&(i, ready)| self.engines.get(i).map(|e| (i, e, ready)));
        write_yaml(&self.work.join(POOL_FILE), &pool_file(self.spec.engines_per_agent, listed))
    }

    /// Kills the picker and starts it again with the same config and ports (empty index; the
    /// agents reconnect and resend snapshots). Returns once it printed READY.
    pub async fn restart_picker(&mut self) -> Result<()> {
        self.stop_picker(0, false).await?;
        self.start_picker(0).await
    }

    /// Stops picker replica `r`: SIGKILL, or with `graceful` SIGTERM and a wait for its exit
    /// (drain: NOT_SERVING first, open streams finish).
    pub async fn stop_picker(&mut self, r: usize, graceful: bool) -> Result<()> {
        let Some(mut p) = self.pickers.get_mut(r).and_then(Option::take) else { return Ok(()) };
        if graceful {
            if let Some(pid) = p.pid() {
                signal(pid, "TERM")?;
            }
            if tokio::time::timeout(Duration::from_secs(15), p.wait()).await.is_err() {
                bail!("picker {r} did not exit within 15 s of SIGTERM; log:\n{}", p.log_tail(20));
            }
        } else {
            p.kill().await;
        }
        Ok(())
    }

    /// Starts picker replica `r` again with its config and ports; returns once it printed READY.
    pub async fn start_picker(&mut self, r: usize) -> Result<()> {
        let args = self.picker_args.get(r).context("no such picker replica")?.clone();
        let p = ManagedProcess::spawn(
            &format!("picker-{r}-restarted"),
            &paths::binary("kvroute-picker")?,
            &args,
            &self.work,
            "READY",
            READY_TIMEOUT,
        )
        .await?;
        if let Some(slot) = self.pickers.get_mut(r) {
            *slot = Some(p);
        }
        Ok(())
    }

    /// Sends `sig` (`STOP`, `CONT`, `TERM`, ...) to agent `a`.
    pub fn signal_agent(&self, a: usize, sig: &str) -> Result<()> {
        signal(self.agent_pid(a).context("agent not running")?, sig)
    }

    /// Kills agent `a` (SIGKILL) and starts it again with the same config; returns once it
    /// printed READY.
    pub async fn restart_agent(&mut self, a: usize) -> Result<()> {
        let args = self.agent_args.get(a).context("no such agent")?.clone();
        if let Some(p) = self.agents.get_mut(a) {
            p.kill().await;
        }
        let p = ManagedProcess::spawn(
            &format!("agent-{a}-restarted"),
            &paths::binary("kvroute-agent")?,
            &args,
            &self.work,
            "READY",
            READY_TIMEOUT,
        )
        .await?;
        if let Some(slot) = self.agents.get_mut(a) {
            *slot = p;
        }
        Ok(())
    }

    /// The picker's `POST /explain` for a chat body (every candidate's factors, no routing).
    pub async fn explain_chat(&self, body: &Value) -> Result<Value> {
        let url = format!("{}/explain?path=/v1/chat/completions", self.picker_admin);
        let r = self.http.post(url).json(body).send().await?;
        Ok(r.error_for_status()?.json().await?)
    }

    /// Agent `a`'s own Prometheus text.
    pub async fn agent_metrics(&self, a: usize) -> Result<String> {
        let url = self.agent_admins.get(a).context("no such agent")?;
        let r = self.http.get(format!("{url}/metrics")).send().await?;
        Ok(r.error_for_status()?.text().await?)
    }

    /// OS process id of agent `a`, if running.
    pub fn agent_pid(&self, a: usize) -> Option<u32> {
        self.agents.get(a).and_then(ManagedProcess::pid)
    }

    /// The ext_proc phases of every request `envoy` has logged so far, oldest first; empty
    /// without `spec.ext_proc_phase_log`. Envoy flushes its access logs every 500 ms
    /// (`start_envoy`).
    pub fn ext_proc_phases(&self, envoy: KvrouteEnvoy) -> Result<Vec<ExtProcPhases>> {
        if !self.spec.ext_proc_phase_log {
            return Ok(Vec::new());
        }
        let path = phase_log_path(&self.work, &envoy.name());
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        Ok(text.lines().filter_map(parse_phase_line).collect())
    }

    /// OS process id of picker replica `r`, if running.
    pub fn picker_pid(&self, r: usize) -> Option<u32> {
        self.pickers.get(r).and_then(Option::as_ref).and_then(ManagedProcess::pid)
    }

    /// OS process id of the no-op ext_proc server (`noop_ext_proc_gateway`), if running.
    pub fn noop_ext_proc_pid(&self) -> Option<u32> {
        self.noop_ext_proc.as_ref().and_then(ManagedProcess::pid)
    }

    /// The tail of agent `a`'s log, for failure messages.
    pub fn agent_log_tail(&self, a: usize, n: usize) -> String {
        self.agents.get(a).map(|p| p.log_tail(n)).unwrap_or_default()
    }

    /// Empties every engine's prefix cache (vLLM's `POST /reset_prefix_cache`).
    pub async fn reset_prefix_caches(&self) -> Result<()> {
        for e in self.engines.iter().filter(|e| e.is_running()) {
            self.http.post(format!("{}/reset_prefix_cache", e.url())).send().await?.error_for_status()?;
        }
        Ok(())
    }

    /// Sets an engine's injected faults (`POST /emulator/faults`).
    pub async fn inject_fault(&self, i: usize, faults: Value) -> Result<()> {
        let e = self.engines.get(i).context("no such engine")?;
        self.http.post(format!("{}/emulator/faults", e.url())).json(&faults).send().await?.error_for_status()?;
        Ok(())
    }

    /// The tail of the (first) picker's log, for failure messages.
    pub fn picker_log_tail(&self, n: usize) -> String {
        self.pickers.iter().flatten().next().map(|p| p.log_tail(n)).unwrap_or_default()
    }

    /// Kills everything (also done on drop).
    pub async fn shutdown(mut self) {
        for p in self.envoys.iter_mut().chain(self.agents.iter_mut()) {
            p.kill().await;
        }
        for p in self.pickers.iter_mut().flatten() {
            p.kill().await;
        }
        if let Some(mut p) = self.noop_ext_proc.take() {
            p.kill().await;
        }
        for e in &mut self.engines {
            if let Some(mut p) = e.process.take() {
                p.kill().await;
            }
        }
    }
}

/// Value of the first sample of `name` whose label set contains `label` (e.g. `model_server_pod="engine-0-rank-0"`).
pub fn metric_value(text: &str, name: &str, label: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let rest = l.strip_prefix(name)?;
        let (labels, value) = rest.rsplit_once(' ')?;
        (labels.starts_with('{') && labels.contains(label)).then(|| value.trim().parse().ok())?
    })
}

fn emulator_args(spec: &FleetSpec, pod: &str, port: u16, kv: u16, replay: u16) -> Vec<String> {
    let mut a: Vec<String> = Vec::new();
    let mut kv_pair = |k: &str, v: String| {
        a.push(k.into());
        a.push(v);
    };
    kv_pair("--host", "127.0.0.1".into());
    kv_pair("--port", port.to_string());
    kv_pair("--model", spec.model.clone());
    kv_pair("--tokenizer", path_arg(&paths::tokenizer_dir()));
    kv_pair("--block-size", spec.emulator_block_size.to_string());
    kv_pair("--num-gpu-blocks", spec.num_gpu_blocks.to_string());
    kv_pair("--max-num-seqs", spec.max_num_seqs.to_string());
    kv_pair("--max-num-partial-prefills", spec.max_num_partial_prefills.to_string());
    kv_pair("--prefill-us-per-token", spec.prefill_us_per_token.to_string());
    kv_pair("--decode-ms-per-token", spec.decode_ms_per_token.to_string());
    kv_pair("--time-scale", spec.time_scale.to_string());
    kv_pair("--kv-events-endpoint", format!("tcp://127.0.0.1:{kv}"));
    kv_pair("--kv-replay-endpoint", format!("tcp://127.0.0.1:{replay}"));
    kv_pair("--kv-topic", format!("kv@127.0.0.1@{}", spec.model));
    kv_pair("--pod-name", pod.into());
    if let Some(n) = spec.image_tokens {
        kv_pair("--mm-tokens-per-image", n.to_string());
    }
    if spec.image_vision {
        a.push("--mm-vision".into());
    }
    a
}

/// The picker's pool file, next to its config.
const POOL_FILE: &str = "pool.yaml";

/// A pool file (`kvroute_cluster::file`) listing `engines` `(index, engine, ready)` as pods
/// `engine-<i>` on 127.0.0.1, each on the node of the agent that reports it (`node-<index /
/// engines_per_agent>`): the picker accepts a pod's reports only from its node's agent.
fn pool_file<'a>(engines_per_agent: usize, engines: impl Iterator<Item = (usize, &'a Engine, bool)>) -> Value {
    let pods: Vec<Value> = engines
        .map(|(i, e, ready)| {
            let node = format!("node-{}", i / engines_per_agent.max(1));
            json!({"name": e.pod, "ip": "127.0.0.1", "ports": [e.port], "ready": ready, "node": node})
        })
        .collect();
    json!({ "pods": pods })
}

fn picker_config(spec: &FleetSpec, ext_proc: u16, ingest: u16, admin: u16) -> Value {
    let mut model = if spec.picker_approximate {
        json!({"name": spec.model, "target_model": spec.model, "adapter": null, "mode": "approximate"})
    } else {
        json!({
            "name": spec.model,
            "target_model": spec.model,
            "adapter": null,
            "tokenizer": path_arg(&paths::tokenizer_dir()),
        })
    };
    if spec.image_vision {
        model["vision"] = json!({});
    } else if let Some(n) = spec.image_tokens {
        model["image_tokens"] = json!(n);
    }
    json!({
        "ext_proc_addr": format!("127.0.0.1:{ext_proc}"),
        // The gRPC health listener on a free port (its default, 9003, is one per host).
        "health_addr": "127.0.0.1:0",
        "ingest_addr": format!("127.0.0.1:{ingest}"),
        "admin_addr": format!("127.0.0.1:{admin}"),
        "block_size": 16,
        "models": [model],
        "pool_file": POOL_FILE,
    })
}

fn agent_config(spec: &FleetSpec, index: usize, engines: &[Engine], ingest: &[u16], metrics_port: u16) -> Value {
    let engines: Vec<Value> = engines
        .iter()
        .enumerate()
        .map(|(gpu, e)| {
            json!({
                "pod": e.pod,
                "endpoint": e.endpoint(),
                "model": spec.model,
                "kv_events": format!("tcp://127.0.0.1:{}", e.kv_events_port),
                "kv_replay": format!("tcp://127.0.0.1:{}", e.kv_replay_port),
                "gpus": [gpu],
                "max_num_seqs": spec.max_num_seqs,
            })
        })
        .collect();
    json!({
        "node_name": format!("node-{index}"),
        "pickers": ingest.iter().map(|p| format!("https://127.0.0.1:{p}")).collect::<Vec<_>>(),
        "metrics_addr": format!("127.0.0.1:{metrics_port}"),
        "report_interval_ms": spec.report_interval_ms,
        "engines": engines,
    })
}

/// A kvroute Envoy config (`deploy/envoy/envoy.yaml` or a variant) with the fleet's ports:
/// listener, admin, picker cluster; with `phase_log`, an access log there of the ext_proc
/// filter's latency per phase ([`PHASE_LOG_FORMAT`]).
fn kvroute_envoy_config(
    path: &Path,
    listener: u16,
    admin: u16,
    pickers: &[u16],
    phase_log: Option<PathBuf>,
) -> Result<Value> {
    let mut cfg = read_yaml(path)?;
    set_listener_and_admin(&mut cfg, listener, admin)?;
    if let Some(log) = phase_log {
        let hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            .as_object_mut()
            .context("envoy config has no http_connection_manager in its first filter chain")?;
        hcm.insert(
            "access_log".into(),
            json!([{
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                    "path": path_arg(&log),
                    "log_format": {"text_format_source": {"inline_string": PHASE_LOG_FORMAT}},
                },
            }]),
        );
    }
    let cluster = cluster_mut(&mut cfg, "kvroute_picker")?;
    let endpoints: Vec<Value> = pickers
        .iter()
        .map(|p| json!({"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}))
        .collect();
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = json!(endpoints);
    Ok(cfg)
}

/// One access-log line per request: `ext_proc` then `phase=µs` for request headers, request
/// body (all chunks), response headers and response body (all chunks), as Envoy's ext_proc filter
/// timed each exchange with its server (`-` where the phase was not sent).
pub const PHASE_LOG_FORMAT: &str = "ext_proc request_headers=%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:request_header_latency_us)% \
request_body=%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:request_body_total_latency_us)% \
response_headers=%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:response_header_latency_us)% \
response_body=%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:response_body_total_latency_us)%\n";

/// One of the fleet's Envoys with an ext_proc filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvrouteEnvoy {
    /// The gateway on `deploy/envoy/envoy.yaml` and the picker.
    Picker,
    /// The gateway on `spec.extra_gateway_configs[i]` and the picker.
    Extra(usize),
    /// The gateway whose ext_proc server is `kvroute-noop-ext-proc`.
    NoOp,
}

impl KvrouteEnvoy {
    /// Its process name, which also names its config and log files in the work directory.
    fn name(self) -> String {
        match self {
            KvrouteEnvoy::Picker => "envoy".to_owned(),
            KvrouteEnvoy::Extra(i) => format!("envoy-extra-{i}"),
            KvrouteEnvoy::NoOp => "envoy-noop-ext-proc".to_owned(),
        }
    }
}

/// Where the Envoy named `name` writes its ext_proc phase log.
fn phase_log_path(work: &Path, name: &str) -> PathBuf {
    work.join(format!("{name}-ext-proc-phases.log"))
}

/// The ext_proc exchanges of one request as Envoy timed them (µs; `None`: phase not sent).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExtProcPhases {
    pub request_headers: Option<u64>,
    pub request_body: Option<u64>,
    pub response_headers: Option<u64>,
    pub response_body: Option<u64>,
}

/// Parses one [`PHASE_LOG_FORMAT`] line; `None` for any other line.
pub fn parse_phase_line(line: &str) -> Option<ExtProcPhases> {
    let rest = line.strip_prefix("ext_proc ")?;
    let mut p = ExtProcPhases::default();
    for field in rest.split_ascii_whitespace() {
        let (key, value) = field.split_once('=')?;
        let value = value.trim_matches('"').parse().ok();
        match key {
            "request_headers" => p.request_headers = value,
            "request_body" => p.request_body = value,
            "response_headers" => p.response_headers = value,
            "response_body" => p.response_body = value,
            _ => return None,
        }
    }
    Some(p)
}

/// `kill -s <sig> <pid>`.
fn signal(pid: u32, sig: &str) -> Result<()> {
    let status = std::process::Command::new("kill").args(["-s", sig, &pid.to_string()]).status()?;
    if !status.success() {
        bail!("kill -s {sig} {pid} failed: {status}");
    }
    Ok(())
}

/// `deploy/envoy/<name>.yaml` (a baseline without kvroute, its pods in `cluster`) with the fleet's
/// ports and engines.
fn baseline_envoy_config(name: &str, cluster: &str, listener: u16, admin: u16, engines: &[Engine]) -> Result<Value> {
    let mut cfg = read_yaml(&paths::repo_root().join(format!("deploy/envoy/{name}.yaml")))?;
    set_listener_and_admin(&mut cfg, listener, admin)?;
    let endpoints: Vec<Value> = engines
        .iter()
        .map(|e| json!({"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": e.port}}}}))
        .collect();
    cluster_mut(&mut cfg, cluster)?["load_assignment"]["endpoints"][0]["lb_endpoints"] = json!(endpoints);
    Ok(cfg)
}

/// The response header naming the upstream address that served a request, which the harness's
/// Envoys add (a real vLLM has no `x-served-by`; see [`GatewayClient::with_endpoint_names`]).
pub const UPSTREAM_HEADER: &str = "x-upstream-endpoint";

fn set_listener_and_admin(cfg: &mut Value, listener: u16, admin: u16) -> Result<()> {
    cfg["admin"]["address"]["socket_address"] = json!({"address": "127.0.0.1", "port_value": admin});
    let l = cfg["static_resources"]["listeners"].get_mut(0).context("envoy config has no listener")?;
    l["address"]["socket_address"] = json!({"address": "127.0.0.1", "port_value": listener});
    let routes = l["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]
        .as_object_mut()
        .context("envoy config has no route_config in its first filter chain")?;
    routes.insert(
        "response_headers_to_add".into(),
        json!([{"header": {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"}}]),
    );
    Ok(())
}

/// A fail-open config's pod list (`kvroute_endpoints` of type STATIC, the `override_host` policy's
/// fallback) set to the fleet's engines; other configs are left as they are.
fn list_engines(cfg: &mut Value, engines: &[Engine]) -> Result<()> {
    let cluster = cluster_mut(cfg, "kvroute_endpoints")?;
    if cluster["type"] != "STATIC" {
        return Ok(());
    }
    let endpoints: Vec<Value> = engines
        .iter()
        .map(|e| json!({"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": e.port}}}}))
        .collect();
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = json!(endpoints);
    Ok(())
}

fn cluster_mut<'a>(cfg: &'a mut Value, name: &str) -> Result<&'a mut Value> {
    cfg["static_resources"]["clusters"]
        .as_array_mut()
        .and_then(|cs| cs.iter_mut().find(|c| c["name"] == name))
        .with_context(|| format!("envoy config has no cluster {name}"))
}

fn admin_url_of(cfg_path: &Path) -> Result<String> {
    let cfg = read_yaml(cfg_path)?;
    let port = cfg["admin"]["address"]["socket_address"]["port_value"].as_u64().context("admin port")?;
    Ok(format!("http://127.0.0.1:{port}"))
}

fn start_envoy(name: &str, bin: &Path, cfg: &Path, work: &Path) -> Result<ManagedProcess> {
    // Access logs (the ext_proc phase log) flushed each 500 ms instead of Envoy's 10 s, so a run
    // can read its last requests' lines right after them.
    let flags =
        ["--disable-hot-restart", "--concurrency", "2", "--log-level", "warn", "--file-flush-interval-msec", "500"];
    let args: Vec<String> = ["-c", &path_arg(cfg)].into_iter().chain(flags).map(str::to_owned).collect();
    ManagedProcess::start(name, bin, &args, work)
}

async fn wait_envoy_ready(http: &reqwest::Client, admin: &str, proc: &ManagedProcess) -> Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Ok(r) = http.get(format!("{admin}/ready")).send().await
            && r.status().is_success()
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{} not ready; log:\n{}", proc.name, proc.log_tail(20));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn read_yaml(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_norway::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

fn write_yaml(path: &Path, value: &Value) -> Result<()> {
    // Write then rename: a watcher polling the file never reads half of it.
    let tmp = path.with_extension("yaml.tmp");
    std::fs::write(&tmp, serde_norway::to_string(value)?).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming onto {}", path.display()))
}

fn path_arg(p: &Path) -> String {
    p.display().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phase_lines_parse_as_envoy_writes_them() {
        // Envoy writes `-` for a phase it did not send (response headers SKIP).
        let p = parse_phase_line("ext_proc request_headers=372 request_body=183 response_headers=- response_body=61")
            .expect("a phase line");
        assert_eq!(
            p,
            ExtProcPhases {
                request_headers: Some(372),
                request_body: Some(183),
                response_headers: None,
                response_body: Some(61)
            }
        );
        assert_eq!(parse_phase_line("[2026-12-02] some other log line"), None);
        assert_eq!(
            parse_phase_line("ext_proc request_headers=1 surprise=2"),
            None,
            "an unknown field is not a phase line"
        );
    }

    #[test]
    fn the_phase_log_is_added_to_the_connection_manager() {
        let deploy = paths::repo_root().join("deploy/envoy/envoy.yaml");
        let log = PathBuf::from("/tmp/x-ext-proc-phases.log");
        let cfg = kvroute_envoy_config(&deploy, 1, 2, &[3], Some(log)).expect("the deploy config");
        let hcm = &cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
        assert_eq!(hcm["access_log"][0]["typed_config"]["path"], "/tmp/x-ext-proc-phases.log");
        assert_eq!(
            hcm["access_log"][0]["typed_config"]["log_format"]["text_format_source"]["inline_string"],
            PHASE_LOG_FORMAT
        );
        let plain = kvroute_envoy_config(&deploy, 1, 2, &[3], None).expect("the deploy config");
        let hcm = &plain["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
        assert!(hcm.get("access_log").is_none(), "no access log unless asked");
    }
}
