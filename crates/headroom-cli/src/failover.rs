//! `headroom bench failover`: how fast a request moves to the CPU worker when the (simulated)
//! GPU fails, and how fast the GPU worker comes back, on real worker processes.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use headroom_model::{GenerateRequest, ModelBundle};
use headroom_router::{BreakerState, EventKind, RunRequest, Supervisor, SupervisorConfig, Target};
use headroom_worker::{Device, Fault, WorkerOptions};

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    if values.is_empty() {
        return f64::NAN;
    }
    values[values.len() / 2]
}

/// A prompt of exactly `n` tokens of on-corpus text.
pub fn prompt_of(bundle: &ModelBundle, n: usize) -> Result<Vec<u32>> {
    let verse = "And God said, Let there be light: and there was light. ";
    let mut text = String::new();
    loop {
        text.push_str(verse);
        let tokens = bundle.encode(&text, true)?;
        if tokens.len() >= n {
            return Ok(tokens[..n].to_vec());
        }
    }
}

pub fn bench_failover(model_dir: &Path, runs: usize, prompt_tokens: usize, max_tokens: usize, json: Option<&Path>) -> Result<()> {
    let bundle = ModelBundle::open(model_dir).with_context(|| format!("cannot open {}", model_dir.display()))?;
    let prompt = prompt_of(&bundle, prompt_tokens)?;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        let program = std::env::current_exe()?;
        let mut config = SupervisorConfig::new(program, model_dir.to_path_buf(), Some(WorkerOptions::new(Device::Sim)));
        // Count OOMs without opening the breaker, so every OOM run is a failover.
        config.supervision.breaker.failure_threshold = u32::MAX;
        config.supervision.health_interval_ms = 200;
        let cooldown_ms = config.supervision.breaker.cooldown_ms;
        let backoff_ms = config.supervision.restart_backoff_initial_ms;
        let supervisor = Supervisor::start(config).await?;
        let mut events = supervisor.subscribe();
        let request = |id: String| RunRequest {
            request_id: id,
            request: GenerateRequest::new(prompt.clone(), max_tokens, Default::default()),
            allow_resume: true,
        };

        let mut cpu_prefill = Vec::new();
        let mut replay = Vec::new();
        let mut resume = Vec::new();
        let mut resume_prefill = Vec::new();
        let mut restore = Vec::new();
        let mut load = Vec::new();
        let mut matched = 0usize;
        for run in 0..runs {
            // CPU prefill of the same prompt, fresh: the floor a replay cannot beat.
            let straight = supervisor.run(request(format!("cpu-{run}")), Target::Cpu, |_| {}).await?;
            cpu_prefill.push(straight.prefill_ms);

            // GPU fails before its first token: the request is replayed on the CPU from the start.
            supervisor.inject_fault(Fault::OomNextAllocation).await?;
            let out = supervisor.run(request(format!("oom-{run}")), Target::Auto, |_| {}).await?;
            let f = out.failovers.first().context("the injected OOM did not fail over")?;
            replay.push(f.failure_to_first_token_ms.context("no first token after failover")?);
            matched += usize::from(out.tokens == straight.tokens);

            // The GPU process dies mid-stream: the request resumes on the CPU after the tokens it
            // delivered, and the supervisor restores the GPU worker.
            while events.try_recv().is_ok() {}
            supervisor.inject_fault(Fault::Reset { after_tokens: Some(4) }).await?;
            let out = supervisor.run(request(format!("reset-{run}")), Target::Auto, |_| {}).await?;
            let f = out.failovers.first().context("the reset did not fail over")?;
            resume.push(f.failure_to_first_token_ms.context("no first token after failover")?);
            resume_prefill.push(out.prefill_ms);
            matched += usize::from(out.tokens == straight.tokens);
            let (mut failed_at, mut loaded_ms) = (None, None);
            let closed_at = tokio::time::timeout(Duration::from_secs(120), async {
                loop {
                    let Ok(event) = events.recv().await else { continue };
                    match event.kind {
                        EventKind::BreakerChanged { to: BreakerState::Open, .. } if failed_at.is_none() => failed_at = Some(event.at_unix_ms),
                        EventKind::WorkerStarted { device, load_ms, .. } if device == "sim" => loaded_ms = Some(load_ms),
                        EventKind::BreakerChanged { to: BreakerState::Closed, .. } => return event.at_unix_ms,
                        _ => {}
                    }
                }
            })
            .await
            .context("the GPU worker was not restored within 120 s")?;
            let (Some(failed_at), Some(loaded_ms)) = (failed_at, loaded_ms) else {
                bail!("missing breaker or restart events for run {run}");
            };
            restore.push((closed_at - failed_at) as f64);
            load.push(loaded_ms);
        }
        supervisor.shutdown().await;

        let cpu = median(&mut cpu_prefill.clone());
        let rep = median(&mut replay.clone());
        let res = median(&mut resume.clone());
        let res_pre = median(&mut resume_prefill.clone());
        let rest = median(&mut restore.clone());
        let ld = median(&mut load.clone());
        println!("failover on the sim GPU, {} ({prompt_tokens}-token prompt, {max_tokens} max tokens), {runs} runs, medians:", bundle.name());
        println!("  CPU prefill of the prompt                       {cpu:8.1} ms");
        println!("  OOM before first token → first CPU token        {rep:8.1} ms  (target ≤ prefill + 50 = {:.1}; {})", cpu + 50.0, if rep <= cpu + 50.0 { "met" } else { "missed" });
        println!("  worker reset after 4 tokens → first CPU token   {res:8.1} ms  (its re-prefill of prompt + 4 tokens: {res_pre:.1} ms)");
        println!("  GPU worker restore (breaker open → closed)      {rest:8.1} ms  (load {ld:.1} ms + 1000 = {:.1}; {}; cool-down {cooldown_ms} ms, first backoff {backoff_ms} ms)", ld + 1000.0, if rest <= ld + 1000.0 { "met" } else { "missed" });
        println!("  token-identical to the straight CPU run         {matched}/{}", 2 * runs);
        if let Some(path) = json {
            let report = serde_json::json!({
                "model": bundle.name(), "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "runs": runs,
                "cpu_prefill_ms": cpu_prefill, "replay_failure_to_first_token_ms": replay,
                "resume_failure_to_first_token_ms": resume, "resume_prefill_ms": resume_prefill,
                "restore_ms": restore, "load_ms": load, "token_identical": matched,
                "breaker_cooldown_ms": cooldown_ms,
            });
            std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
        }
        Ok(())
    })
}
