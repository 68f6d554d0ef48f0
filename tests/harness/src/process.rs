//! A child process that announced it is ready, killed when dropped.

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

/// A running child. Its stderr goes to `<work>/<name>.log`, its stdout to `<work>/<name>.out`.
pub struct ManagedProcess {
    pub name: String,
    pub log: PathBuf,
    child: Child,
    /// Started as the leader of its own process group ([`ManagedProcess::start_group`]): killing
    /// it kills the group (vLLM's API server leaves its engine-core and worker processes behind
    /// otherwise).
    group: bool,
}

impl ManagedProcess {
    /// Starts `program args…` and waits until a stdout line starts with `ready_prefix`
    /// (kvroute binaries print `READY`). Fails with the tail of its log when it exits first or
    /// `timeout` passes.
    pub async fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        work: &Path,
        ready_prefix: &str,
        timeout: Duration,
    ) -> Result<Self> {
        let mut me = Self::start(name, program, args, work)?;
        let stdout = me.child.stdout.take().context("child stdout")?;
        let out_path = work.join(format!("{name}.out"));
        let mut out_file = tokio::fs::File::create(&out_path).await?;
        let mut lines = BufReader::new(stdout).lines();
        let ready = tokio::time::timeout(timeout, async {
            while let Ok(Some(line)) = lines.next_line().await {
                let _ = out_file.write_all(format!("{line}\n").as_bytes()).await;
                if line.starts_with(ready_prefix) {
                    return true;
                }
            }
            false
        })
        .await
        .unwrap_or(false);
        if !ready {
            let tail = me.log_tail(30);
            bail!("{name} did not become ready within {timeout:?}; last log lines:\n{tail}");
        }
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                let _ = out_file.write_all(format!("{line}\n").as_bytes()).await;
            }
        });
        Ok(me)
    }

    /// Starts a process without waiting for anything (Envoy: poll its admin `/ready` instead).
    pub fn start(name: &str, program: &Path, args: &[String], work: &Path) -> Result<Self> {
        Self::start_with(name, program, args, &[], false, work)
    }

    /// Like [`start`](Self::start) with extra environment `env`, as the leader of a new process
    /// group that is killed whole (SIGKILL) when the process is killed or dropped. Its stdout
    /// goes to the log with its stderr.
    pub fn start_group(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        work: &Path,
    ) -> Result<Self> {
        Self::start_with(name, program, args, env, true, work)
    }

    fn start_with(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        group: bool,
        work: &Path,
    ) -> Result<Self> {
        let log = work.join(format!("{name}.log"));
        let err = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut cmd = Command::new(program);
        cmd.args(args).envs(env.iter().map(|(k, v)| (k, v))).stdin(Stdio::null()).kill_on_drop(true);
        if group {
            cmd.process_group(0).stdout(Stdio::from(err.try_clone()?)).stderr(Stdio::from(err));
        } else {
            cmd.stdout(Stdio::piped()).stderr(Stdio::from(err));
        }
        let child = cmd.spawn().with_context(|| format!("starting {name} ({})", program.display()))?;
        Ok(Self { name: name.to_string(), log, child, group })
    }

    /// Whether the process has exited (it is reaped then).
    pub fn has_exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// SIGKILL to the process group this process leads, if it leads one and still runs.
    fn kill_group(&self) {
        if let (true, Some(pid)) = (self.group, self.child.id()) {
            let _ = std::process::Command::new("kill")
                .args(["-s", "KILL", "--", &format!("-{pid}")])
                .stderr(Stdio::null())
                .status();
        }
    }

    /// The last `n` lines of the process's log (stderr).
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Kills the process (and its group, see [`start_group`](Self::start_group)) and waits for it.
    pub async fn kill(&mut self) {
        self.kill_group();
        let _ = self.child.kill().await;
    }

    /// Waits for the process to exit on its own.
    pub async fn wait(&mut self) {
        let _ = self.child.wait().await;
    }

    /// OS process id, if still running.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }
}

impl Drop for ManagedProcess {
    fn drop(&mut self) {
        self.kill_group();
    }
}
