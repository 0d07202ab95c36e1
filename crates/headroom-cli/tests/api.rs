//! The HTTP API in process (axum app, no socket) over real worker processes: OpenAI shapes,
//! streaming, errors, idempotency, cancellation, degraded headers after a sim OOM, auth, metrics.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use headroom_memory::{MemoryConfig, SplitPlan};
use headroom_model::ModelBundle;
use headroom_router::{Dispatcher, Journal, QueueConfig, RequestState, Settings, SettingsFile, Supervisor, SupervisorConfig};
use headroom_server::{AppState, Limits, ServerConfig};
use headroom_worker::{Device, WorkerOptions};
use serde_json::{json, Value};
use tower::ServiceExt;

struct Api {
    app: axum::Router,
    dispatcher: Dispatcher,
}

async fn api(with_sim_gpu: bool, api_key: Option<&str>) -> Api {
    api_saving_settings(with_sim_gpu, api_key, None).await
}

async fn api_saving_settings(with_sim_gpu: bool, api_key: Option<&str>, settings_file: Option<SettingsFile>) -> Api {
    api_with(with_sim_gpu, api_key, settings_file, Settings::default()).await
}

/// An API whose service starts with `settings` in force (as `serve` does with a saved file).
async fn api_with(with_sim_gpu: bool, api_key: Option<&str>, settings_file: Option<SettingsFile>, settings: Settings) -> Api {
    api_placed(with_sim_gpu, api_key, settings_file, settings, None).await
}

/// The same, with the layer plan `serve` made at start.
async fn api_placed(with_sim_gpu: bool, api_key: Option<&str>, settings_file: Option<SettingsFile>, settings: Settings, placement: Option<SplitPlan>) -> Api {
    let model_dir = headroom_model::bundle::resolve_model(headroom_model::bundle::DEMO_MODEL);
    let sim = with_sim_gpu.then(|| {
        let mut sim = WorkerOptions::new(Device::Sim);
        sim.memory_sample_ms = 0;
        sim
    });
    let mut config = SupervisorConfig::new(PathBuf::from(env!("CARGO_BIN_EXE_headroom")), model_dir.clone(), sim);
    config.cpu.max_concurrency = 1;
    config.supervision.health_interval_ms = 200;
    config.gpu_paused = settings.gpu_paused;
    config.placement = placement;
    let supervisor = Supervisor::start(config).await.unwrap();
    let bundle = ModelBundle::open(&model_dir).unwrap();
    let memory = MemoryConfig::default();
    let (planner, _) = headroom_memory::planner_for(&bundle, "cpu", memory.clone());
    let (dispatcher, _) = Dispatcher::start(supervisor, Journal::in_memory().unwrap(), planner, memory, QueueConfig::default(), settings, settings_file).unwrap();
    let state = Arc::new(AppState {
        dispatcher: dispatcher.clone(),
        limits: Limits { context_tokens: bundle.config.max_position_embeddings, default_max_tokens: 32 },
        model_id: bundle.name(),
        bundle: Arc::new(bundle),
        role: Default::default(),
        models: Default::default(),
        api_key: api_key.map(str::to_string),
        sim_faults: with_sim_gpu,
        created_unix: 0,
    });
    let app = headroom_server::app(state, &ServerConfig::default());
    Api { app, dispatcher }
}

struct Reply {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    text: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text))
    }
    fn header(&self, name: &str) -> &str {
        self.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_else(|| panic!("no {name} header"))
    }
    /// The `data:` payloads of an SSE body.
    fn sse_data(&self) -> Vec<String> {
        self.text.lines().filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:"))).map(str::to_string).collect()
    }
}

impl Api {
    async fn call(&self, method: &str, path: &str, headers: &[(&str, &str)], body: Option<String>) -> Reply {
        let mut req = Request::builder().method(method).uri(path);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.header("content-type", "application/json").body(body.map(Body::from).unwrap_or_else(Body::empty)).unwrap();
        let response = self.app.clone().oneshot(req).await.unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = axum::body::to_bytes(response.into_body(), 64 << 20).await.unwrap();
        Reply { status, headers, text: String::from_utf8_lossy(&bytes).into_owned() }
    }

    async fn chat(&self, body: Value, headers: &[(&str, &str)]) -> Reply {
        self.call("POST", "/v1/chat/completions", headers, Some(body.to_string())).await
    }

    async fn stop(self) {
        self.dispatcher.supervisor().shutdown().await;
    }
}

fn chat_body(max_tokens: u32, seed: u64, stream: bool) -> Value {
    json!({
        "model": "default",
        "messages": [{"role": "user", "content": "And God said"}],
        "max_tokens": max_tokens, "seed": seed, "temperature": 0.8, "stream": stream,
        "stream_options": {"include_usage": true},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streams_in_openai_chunks_and_matches_the_plain_answer() {
    let api = api(false, None).await;
    let plain = api.chat(chat_body(16, 7, false), &[]).await;
    assert_eq!(plain.status, StatusCode::OK, "{}", plain.text);
    let body = plain.json();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert_eq!(body["usage"]["completion_tokens"].as_u64().unwrap() + body["usage"]["prompt_tokens"].as_u64().unwrap(), body["usage"]["total_tokens"].as_u64().unwrap());
    assert_eq!(plain.header("x-headroom-device"), "cpu");
    assert_eq!(plain.header("x-headroom-degraded"), "false");
    let id = plain.header("x-request-id").to_string();
    assert_eq!(body["headroom"]["request_id"], id.as_str());
    let record = api.call("GET", &format!("/v1/requests/{id}"), &[], None).await.json();
    assert_eq!(record["state"], "completed");
    assert!(record["transitions"].as_array().unwrap().len() >= 3);

    let streamed = api.chat(chat_body(16, 7, true), &[]).await;
    assert_eq!(streamed.status, StatusCode::OK);
    assert!(streamed.header("content-type").starts_with("text/event-stream"));
    let data = streamed.sse_data();
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, body["choices"][0]["message"]["content"].as_str().unwrap(), "same seed, same text");
    let finish = &chunks[chunks.len() - 2];
    assert!(finish["choices"][0]["finish_reason"].is_string());
    assert_eq!(finish["headroom"]["device"], "cpu");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
    assert_eq!(usage["usage"]["completion_tokens"], body["usage"]["completion_tokens"]);

    // Legacy completions, and the metrics those requests left.
    let c = api.call("POST", "/v1/completions", &[], Some(json!({"model": "default", "prompt": "In the beginning", "max_tokens": 5, "seed": 1}).to_string())).await;
    assert_eq!(c.status, StatusCode::OK, "{}", c.text);
    assert_eq!(c.json()["object"], "text_completion");
    let metrics = api.call("GET", "/metrics", &[], None).await.text;
    assert!(metrics.contains(r#"headroom_requests_total{device="cpu",outcome="completed"} 3"#), "{metrics}");
    assert!(metrics.contains("headroom_queue_capacity{device=\"cpu\"} 16"), "{metrics}");
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_4xx_with_an_openai_error_that_says_what_to_fix() {
    let api = api(false, None).await;
    let cases: Vec<(String, StatusCode, &str)> = vec![
        ("{not json".into(), StatusCode::BAD_REQUEST, "invalid request body"),
        (json!({"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}).to_string(), StatusCode::BAD_REQUEST, "invalid"),
        (json!({"model": "default", "messages": []}).to_string(), StatusCode::BAD_REQUEST, "messages is empty"),
        (json!({"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000000000u64}).to_string(), StatusCode::BAD_REQUEST, "context"),
        (json!({"model": "default", "messages": [{"role": "user", "content": "hi"}], "n": 2}).to_string(), StatusCode::BAD_REQUEST, "n = 2"),
        (json!({"model": "default", "messages": [{"role": "wizard", "content": "hi"}]}).to_string(), StatusCode::BAD_REQUEST, "role"),
        (json!({"model": "default", "messages": [{"role": "user", "content": "hi"}], "temperature": 9}).to_string(), StatusCode::BAD_REQUEST, "temperature"),
        (json!({"model": "/etc/passwd", "messages": [{"role": "user", "content": "hi"}]}).to_string(), StatusCode::NOT_FOUND, "not served here"),
    ];
    for (body, status, needle) in cases {
        let r = api.call("POST", "/v1/chat/completions", &[], Some(body.clone())).await;
        assert_eq!(r.status, status, "{body}: {}", r.text);
        let message = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(message.contains(needle), "{body}: {message}");
        assert!(r.headers.contains_key("x-request-id"));
    }
    // Past the body limit (4 MiB by default): a 413 with the same error shape.
    let huge = json!({"model": "default", "messages": [{"role": "user", "content": "a".repeat(5 << 20)}]}).to_string();
    let r = api.call("POST", "/v1/chat/completions", &[], Some(huge)).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE, "{}", r.text);
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("body"), "{}", r.text);
    let r = api.call("GET", "/v1/nothing", &[], None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert!(r.json()["error"]["message"].is_string());
    let r = api.call("GET", "/v1/requests/req_unknown", &[], None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    // Nothing was accepted, so nothing is in the journal.
    assert!(api.dispatcher.journal().counts().unwrap().is_empty());
    let spec = api.call("GET", "/openapi.json", &[], None).await.json();
    assert!(spec["paths"]["/v1/chat/completions"]["post"].is_object());
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_key_returns_the_same_completion_and_refuses_another_body() {
    let api = api(false, None).await;
    let key = [("idempotency-key", "order-1")];
    let first = api.chat(chat_body(8, 3, false), &key).await;
    let again = api.chat(chat_body(8, 3, false), &key).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(again.status, StatusCode::OK);
    assert_eq!(first.json()["choices"], again.json()["choices"]);
    assert_eq!(again.json()["headroom"]["from_journal"], true);
    assert_eq!(again.header("x-request-id"), first.header("x-request-id"));
    let other = api.chat(chat_body(9, 3, false), &key).await;
    assert_eq!(other.status, StatusCode::CONFLICT, "{}", other.text);
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_stream_ends_with_an_error_and_frees_the_worker() {
    let api = Arc::new(api(false, None).await);
    let streaming = {
        let api = api.clone();
        let mut body = chat_body(900, 1, true);
        body["ignore_eos"] = json!(true);
        tokio::spawn(async move { api.chat(body, &[]).await })
    };
    // Wait until it runs, then cancel it by id.
    let journal = api.dispatcher.journal();
    let mut waited = 0;
    let id = loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        waited += 1;
        assert!(waited < 1200, "the stream never started");
        if let Some(id) = api.dispatcher.in_flight_ids().into_iter().find(|id| journal.get(id).unwrap().state == RequestState::Running) {
            break id;
        }
    };
    let r = api.call("POST", &format!("/v1/requests/{id}/cancel"), &[], None).await;
    assert_eq!(r.json()["cancelled"], true, "{}", r.text);
    let streamed = streaming.await.unwrap();
    let data = streamed.sse_data();
    assert_eq!(data.last().unwrap(), "[DONE]");
    assert!(data[data.len() - 2].contains("cancelled"), "{:?}", &data[data.len() - 2]);
    assert_eq!(journal.get(&id).unwrap().state, RequestState::Cancelled);
    // The worker is free for the next request.
    let next = api.chat(chat_body(4, 1, false), &[]).await;
    assert_eq!(next.status, StatusCode::OK, "{}", next.text);
    let again = api.call("POST", &format!("/v1/requests/{id}/cancel"), &[], None).await.json();
    assert_eq!((again["cancelled"].as_bool(), again["state"].as_str()), (Some(false), Some("cancelled")));
    Arc::try_unwrap(api).ok().unwrap().stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sim_oom_is_served_by_the_cpu_and_every_surface_says_degraded() {
    let api = api(true, None).await;
    let healthy = api.chat(chat_body(4, 2, false), &[]).await;
    assert_eq!(healthy.header("x-headroom-device"), "sim", "{}", healthy.text);
    // The memory panel's reserve line and grants come from the budget admission uses.
    let idle = api.call("GET", "/v1/status", &[], None).await.json();
    assert!(idle["memory"]["vram_reserve_bytes"].as_u64().is_some_and(|r| r > 0), "{idle}");
    assert!(idle["memory"]["gpu_held_bytes"].is_u64(), "{idle}");
    let r = api.call("POST", "/admin/sim/fault", &[], Some(json!({"fault": "oom_next_allocation"}).to_string())).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let failed_over = api.chat(chat_body(4, 2, false), &[]).await;
    assert_eq!(failed_over.status, StatusCode::OK, "{}", failed_over.text);
    assert_eq!(failed_over.header("x-headroom-device"), "cpu");
    assert_eq!(failed_over.header("x-headroom-degraded"), "true");
    assert!(failed_over.headers.contains_key("x-headroom-degraded-reason"));
    let body = failed_over.json();
    assert_eq!(body["headroom"]["failovers"][0]["from"], "sim");
    assert_eq!(body["choices"], healthy.json()["choices"], "the replay says what the GPU would have");
    let status = api.call("GET", "/v1/status", &[], None).await.json();
    // People read one plain sentence: what happened, which model on the CPU answers, up to how
    // many tokens; the failure's own words stay in the reason.
    let summary = body["headroom"]["degraded_summary"].as_str().unwrap_or_default();
    let cpu_model = status["workers"][1]["model"].as_str().unwrap();
    let cpu_context = status["workers"][1]["context_tokens"].as_u64().expect("the CPU worker's context limit in /v1/status");
    assert!(summary.starts_with(&format!("The GPU is out of memory; {cpu_model} on the CPU is answering")) && summary.ends_with(" tokens."), "plain summary: {summary:?}");
    assert!(summary.contains(&format!("up to {}k tokens", cpu_context / 1024)) || summary.contains(&format!("up to {cpu_context} tokens")), "plain summary names the CPU's limit {cpu_context}: {summary:?}");
    assert!(body["headroom"]["degraded_reason"].as_str().is_some_and(|r| r.contains("out-of-memory") || r.contains("out of memory")), "{body}");
    assert_eq!(status["workers"][0]["kind"], "gpu");
    assert_eq!(status["workers"][0]["simulated"], true);
    assert!(status["breaker"].is_string());
    let metrics = api.call("GET", "/metrics", &[], None).await.text;
    assert!(metrics.contains(r#"headroom_failovers_total{from="sim",to="cpu"} 1"#), "{metrics}");
    api.stop().await;
}

/// Its negative control: a "summary" that is only the engineering reason fails the check.
#[test]
fn the_plain_summary_check_fails_when_it_is_the_reason() {
    headroom_model::assert_control_fails("a_sim_oom_is_served_by_the_cpu_and_every_surface_says_degraded", "summary-is-reason", "plain summary");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_an_api_key_only_the_probes_are_open() {
    let api = api(false, Some("s3cret")).await;
    assert_eq!(api.call("GET", "/v1/models", &[], None).await.status, StatusCode::UNAUTHORIZED);
    assert_eq!(api.call("GET", "/v1/models", &[("authorization", "Bearer wrong")], None).await.status, StatusCode::UNAUTHORIZED);
    let models = api.call("GET", "/v1/models", &[("authorization", "Bearer s3cret")], None).await;
    assert_eq!(models.json()["data"][0]["id"], "kjv-demo");
    assert_eq!(api.call("GET", "/healthz", &[], None).await.status, StatusCode::OK);
    assert_eq!(api.call("GET", "/readyz", &[], None).await.status, StatusCode::OK);
    // CORS: the desktop app's origin may call the API from a browser context; others may not.
    let preflight = |origin: &'static str| {
        [("origin", origin), ("access-control-request-method", "POST"), ("access-control-request-headers", "authorization,content-type")]
    };
    let app = api.call("OPTIONS", "/v1/chat/completions", &preflight("tauri://localhost"), None).await;
    assert_eq!(app.header("access-control-allow-origin"), "tauri://localhost");
    let other = api.call("OPTIONS", "/v1/chat/completions", &preflight("https://evil.example"), None).await;
    assert!(!other.headers.contains_key("access-control-allow-origin"), "{:?}", other.headers);
    api.stop().await;
}

/// Polls `/v1/status` until `ready` holds (the GPU worker stops or starts in the background).
async fn wait_for_status(api: &Api, what: &str, ready: impl Fn(&Value) -> bool) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let status = api.call("GET", "/v1/status", &[], None).await.json();
        if ready(&status) {
            return status;
        }
        assert!(std::time::Instant::now() < deadline, "timed out waiting for {what}: {status}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn gpu_worker(status: &Value) -> &Value {
    status["workers"].as_array().unwrap().iter().find(|w| w["kind"] == "gpu").unwrap()
}

/// A VRAM reserve changed in Settings reaches the sim GPU worker, which keeps it free itself
/// when its requests take KV blocks under overcommit (its reading says so), and the worker that
/// replaces it after a kill -9 launches with it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserve_changed_in_settings_reaches_the_sim_worker_and_its_successor() {
    let api = api(true, None).await;
    let kept = |s: &Value| s["memory"]["gpu"]["kept_free_bytes"].as_u64();
    let first = wait_for_status(&api, "the GPU worker to be ready", |s| gpu_worker(s)["state"] == "ready" && kept(s).is_some()).await;
    assert_eq!(kept(&first), Some(0), "launched without a reserve of its own: {first}");
    let r = api.call("PATCH", "/v1/settings", &[], Some(r#"{"vram_reserve_mib": 300}"#.into())).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let within = |secs: u64, what: &'static str, ready: &'static (dyn Fn(&Value) -> bool + Sync)| {
        let api = &api;
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(secs);
            loop {
                let status = api.call("GET", "/v1/status", &[], None).await.json();
                if ready(&status) {
                    return status;
                }
                assert!(std::time::Instant::now() < deadline, "the sim worker did not {what}: {}", status["memory"]["gpu"]);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    within(10, "keep the new reserve free", &|s| s["memory"]["gpu"]["kept_free_bytes"] == json!(300u64 << 20)).await;
    let pid = api.dispatcher.supervisor().gpu_worker().unwrap().pid;
    assert!(std::process::Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap().success());
    let pid = pid as u64;
    wait_for_status(&api, "a new GPU worker", |s| gpu_worker(s)["pid"].as_u64().is_some_and(|p| p != pid) && gpu_worker(s)["state"] == "ready").await;
    within(10, "launch its successor with the new reserve", &|s| s["memory"]["gpu"]["kept_free_bytes"] == json!(300u64 << 20)).await;
    api.stop().await;
}

/// Its negative control: a worker that keeps its launch's reserve fails the check.
#[test]
fn the_live_reserve_check_fails_when_the_worker_keeps_its_launch_reserve() {
    headroom_model::assert_control_fails("a_reserve_changed_in_settings_reaches_the_sim_worker_and_its_successor", "reserve-fixed-at-launch", "keep the new reserve free");
}

/// `gpu_layers` in Settings: a count the model does not have, or more layers than the start's
/// plan found room for, is a 400 that says what fits; "auto" and a count that fits are saved
/// for the next start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gpu_layers_setting_says_what_fits() {
    let bundle = ModelBundle::open(headroom_model::bundle::resolve_model(headroom_model::bundle::DEMO_MODEL)).unwrap();
    // The plan of a sim GPU with room for two of the demo model's four layers.
    let plan = (1..4096u64)
        .map(|kib| headroom_memory::plan_model_split(&bundle, "sim", &MemoryConfig::default(), kib * 1024 * 16, 1, 256, Default::default()).unwrap())
        .find(|p| p.most_gpu_layers == 2)
        .expect("some size holds two layers");
    let api = api_placed(true, None, None, Settings::default(), Some(plan)).await;
    let status = api.call("GET", "/v1/status", &[], None).await.json();
    assert_eq!(status["placement"]["placement"], "split: 2 of 4 layers on the GPU", "{status}");
    for (body, says) in [
        (r#"{"gpu_layers": 9}"#, "kjv-demo has 4 layers"),
        (r#"{"gpu_layers": 3}"#, "at most 2 of the 4 layers fit"),
        (r#"{"gpu_layers": "lots"}"#, r#"gpu_layers must be "auto" or a layer count"#),
    ] {
        let r = api.call("PATCH", "/v1/settings", &[], Some(body.into())).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {}", r.text);
        assert!(r.json()["error"]["message"].as_str().unwrap().contains(says), "{body}: {}", r.text);
    }
    for (body, value) in [(r#"{"gpu_layers": 2}"#, json!(2)), (r#"{"gpu_layers": "auto"}"#, json!("auto")), (r#"{"gpu_layers": null}"#, Value::Null)] {
        let r = api.call("PATCH", "/v1/settings", &[], Some(body.into())).await;
        assert_eq!(r.status, StatusCode::OK, "{body}: {}", r.text);
        assert_eq!(r.json()["settings"]["gpu_layers"], value, "{body}");
        assert_eq!(r.json()["restart_required"], json!(["gpu_layers"]), "{body}");
    }
}

/// Its negative control: with the check switched off, a count that does not fit is accepted.
#[test]
fn the_gpu_layers_check_fails_when_switched_off() {
    headroom_model::assert_control_fails("the_gpu_layers_setting_says_what_fits", "gpu-layers-unchecked", "gpu_layers\": 3");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_apply_live_persist_and_refuse_bad_values() {
    let dir = tempfile::tempdir().unwrap();
    let file = SettingsFile::in_dir(dir.path());
    let api = api_saving_settings(true, None, Some(file.clone())).await;
    let got = api.call("GET", "/v1/settings", &[], None).await;
    assert_eq!(got.status, StatusCode::OK);
    assert_eq!(got.json()["settings"], serde_json::to_value(Settings::default()).unwrap());

    // Bad input: a 400 naming the problem, and nothing changes.
    for (body, says) in [(r#"{"vram_reserve": 1}"#, "unknown setting"), (r#"{"cpu_max_concurrency": 99}"#, "1 to 16"), ("[]", "JSON object"), ("{", "invalid request body")] {
        let r = api.call("PATCH", "/v1/settings", &[], Some(body.into())).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {}", r.text);
        assert!(r.json()["error"]["message"].as_str().unwrap().contains(says), "{body}: {}", r.text);
    }
    assert_eq!(file.load().unwrap(), None, "nothing saved by refused changes");

    // The VRAM reserve applies to the next admission: status shows the budget admission uses.
    wait_for_status(&api, "a GPU memory reading", |s| s["memory"]["vram_reserve_bytes"].is_u64()).await;
    let r = api.call("PATCH", "/v1/settings", &[], Some(r#"{"vram_reserve_mib": 100}"#.into())).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.json()["changed"], json!(["vram_reserve_mib"]));
    assert_eq!(r.json()["restart_required"], json!([]));
    let status = api.call("GET", "/v1/status", &[], None).await.json();
    assert_eq!(status["memory"]["vram_reserve_bytes"], 100 << 20);

    // Pausing the GPU: new requests go to the CPU with the reason; the GPU worker exits.
    let r = api.call("PATCH", "/v1/settings", &[], Some(r#"{"gpu_paused": true}"#.into())).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let status = wait_for_status(&api, "the GPU worker to stop", |s| gpu_worker(s)["pid"].is_null()).await;
    assert_eq!(status["gpu_paused"], true);
    assert_eq!(gpu_worker(&status)["state"], "paused");
    let reply = api.chat(chat_body(4, 1, false), &[]).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    assert_eq!(reply.header("x-headroom-device"), "cpu");
    assert!(reply.header("x-headroom-degraded-reason").contains("paused"), "{}", reply.header("x-headroom-degraded-reason"));

    // Resuming starts the GPU worker again and requests go back to it.
    let r = api.call("PATCH", "/v1/settings", &[], Some(r#"{"gpu_paused": false}"#.into())).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    wait_for_status(&api, "the GPU worker to be ready", |s| gpu_worker(s)["state"] == "ready" && s["memory"]["vram_reserve_bytes"].is_u64()).await;
    let reply = api.chat(chat_body(4, 1, false), &[]).await;
    assert_eq!(reply.header("x-headroom-device"), "sim");

    // CPU concurrency: a new CPU worker takes over without a gap, the queue gets two slots.
    let cpu_pid = |s: &Value| s["workers"].as_array().unwrap().iter().find(|w| w["kind"] == "cpu").unwrap()["pid"].clone();
    let before = cpu_pid(&api.call("GET", "/v1/status", &[], None).await.json());
    let r = api.call("PATCH", "/v1/settings", &[], Some(r#"{"cpu_max_concurrency": 2, "gpu_device": 1}"#.into())).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    assert_eq!(r.json()["restart_required"], json!(["gpu_device"]));
    let status = api.call("GET", "/v1/status", &[], None).await.json();
    assert_ne!(cpu_pid(&status), before, "a new CPU worker");
    let cpu_queue = status["queues"].as_array().unwrap().iter().find(|q| q["device"] == "cpu").unwrap().clone();
    assert_eq!(cpu_queue["concurrency"], 2);
    let reply = api.call("POST", "/v1/completions", &[], Some(json!({"model": "default", "prompt": "In the", "max_tokens": 3}).to_string())).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);

    // All of it was saved, and survives a restart (the file is what `serve` reads).
    let saved = file.load().unwrap().unwrap();
    assert_eq!((saved.vram_reserve_mib, saved.gpu_paused, saved.cpu_max_concurrency, saved.gpu_device), (Some(100), false, 2, 1));
    api.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_saved_as_paused_is_not_started_until_resumed() {
    let api = api_with(true, None, None, Settings { gpu_paused: true, ..Settings::default() }).await;
    let status = api.call("GET", "/v1/status", &[], None).await.json();
    assert_eq!(status["gpu_paused"], true);
    assert!(gpu_worker(&status)["pid"].is_null(), "no GPU worker while paused: {status}");
    let metrics = api.call("GET", "/metrics", &[], None).await.text;
    assert!(metrics.lines().any(|l| l.starts_with("headroom_gpu_paused ") && l.ends_with(" 1")), "{metrics}");
    let reply = api.chat(chat_body(2, 1, false), &[]).await;
    assert_eq!(reply.header("x-headroom-device"), "cpu");
    let r = api.call("PATCH", "/v1/settings", &[], Some(r#"{"gpu_paused": false}"#.into())).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    wait_for_status(&api, "the GPU worker to start", |s| gpu_worker(s)["state"] == "ready" && s["memory"]["vram_reserve_bytes"].is_u64()).await;
    assert_eq!(api.chat(chat_body(2, 1, false), &[]).await.header("x-headroom-device"), "sim");
    api.stop().await;
}

/// NDJSON lines of an Ollama stream, parsed.
fn ndjson(reply: &Reply) -> Vec<Value> {
    reply.text.lines().filter(|l| !l.trim().is_empty()).map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"))).collect()
}

fn ollama_chat(num_predict: i64, seed: u64, stream: bool) -> Value {
    json!({"model": "kjv-demo:latest", "messages": [{"role": "user", "content": "And God said"}], "stream": stream,
        "options": {"num_predict": num_predict, "seed": seed, "temperature": 0.8}})
}

/// Ollama's API answers in Ollama's shapes through the same request path: the same seed gives
/// the same text as the OpenAI route, streamed as NDJSON whose last object carries the
/// measured timings and Headroom's `headroom` object; the model listing, details, loaded
/// models and version are there for Ollama's clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ollama_api_answers_in_ollama_shapes() {
    let api = api(false, None).await;
    let openai = api.chat(chat_body(12, 7, false), &[]).await.json();
    let expected = openai["choices"][0]["message"]["content"].as_str().unwrap().to_string();

    let plain = api.call("POST", "/api/chat", &[], Some(ollama_chat(12, 7, false).to_string())).await;
    assert_eq!(plain.status, StatusCode::OK, "{}", plain.text);
    let body = plain.json();
    assert_eq!(body["message"]["role"], "assistant");
    assert_eq!(body["message"]["content"], expected.as_str(), "same seed, same text as /v1/chat/completions");
    assert_eq!(body["done"], true);
    assert!(body["done_reason"] == "stop" || body["done_reason"] == "length", "{body}");
    assert_eq!(body["eval_count"], openai["usage"]["completion_tokens"]);
    assert_eq!(body["prompt_eval_count"], openai["usage"]["prompt_tokens"]);
    for field in ["total_duration", "prompt_eval_duration", "eval_duration"] {
        assert!(body[field].as_u64().is_some_and(|ns| ns > 0), "{field} measured: {body}");
    }
    assert!(body["total_duration"].as_u64() >= body["eval_duration"].as_u64());
    assert!(body["created_at"].as_str().unwrap().ends_with('Z'));
    assert_eq!(body["headroom"]["device"], "cpu");
    assert_eq!(plain.header("x-headroom-device"), "cpu");

    let streamed = api.call("POST", "/api/chat", &[], Some(ollama_chat(12, 7, true).to_string())).await;
    assert_eq!(streamed.status, StatusCode::OK);
    assert_eq!(streamed.header("content-type"), "application/x-ndjson");
    let lines = ndjson(&streamed);
    let (last, pieces) = lines.split_last().unwrap();
    assert!(pieces.iter().all(|l| l["done"] == false && l["model"] == "kjv-demo:latest"));
    let text: String = pieces.iter().map(|l| l["message"]["content"].as_str().unwrap()).collect();
    assert_eq!(text, expected, "the stream says what the plain answer does");
    assert_eq!(last["done"], true);
    assert_eq!(last["eval_count"], body["eval_count"]);
    assert!(last["eval_duration"].as_u64().is_some_and(|ns| ns > 0));
    assert!(last["headroom"]["request_id"].is_string());

    let generated = api.call("POST", "/api/generate", &[], Some(json!({"model": "kjv-demo", "prompt": "In the beginning", "stream": false, "options": {"num_predict": 5, "seed": 1}}).to_string())).await;
    assert_eq!(generated.status, StatusCode::OK, "{}", generated.text);
    assert!(generated.json()["response"].is_string());
    assert!(generated.json()["eval_count"].as_u64().unwrap() <= 5);
    let raw = api.call("POST", "/api/generate", &[], Some(json!({"model": "kjv-demo", "prompt": "In the beginning", "raw": true, "options": {"num_predict": 4}}).to_string())).await;
    let lines = ndjson(&raw);
    assert!(lines.last().unwrap()["done"] == true && lines.iter().all(|l| l["response"].is_string()), "{}", raw.text);
    let load = api.call("POST", "/api/generate", &[], Some(json!({"model": "kjv-demo"}).to_string())).await.json();
    assert_eq!((load["done"].clone(), load["done_reason"].clone()), (json!(true), json!("load")));

    let tags = api.call("GET", "/api/tags", &[], None).await.json();
    assert_eq!(tags["models"][0]["name"], "kjv-demo:latest");
    assert!(tags["models"][0]["size"].as_u64().is_some_and(|b| b > 0));
    assert!(tags["models"][0]["details"]["parameter_size"].as_str().unwrap().ends_with('M'));
    let show = api.call("POST", "/api/show", &[], Some(json!({"model": "kjv-demo"}).to_string())).await.json();
    assert_eq!(show["model_info"]["general.architecture"], "llama");
    assert!(show["model_info"]["llama.context_length"].as_u64().is_some_and(|c| c > 0), "{show}");
    let ps = api.call("GET", "/api/ps", &[], None).await.json();
    assert_eq!(ps["models"][0]["headroom"]["device"], "cpu");
    assert_eq!(ps["models"][0]["size_vram"], 0);
    assert!(api.call("GET", "/api/version", &[], None).await.json()["version"].is_string());
    api.stop().await;
}

/// Ollama's keep_alive on a sim GPU: `keep_alive: 0` on a load call unloads the GPU's copy
/// (its worker exits, `/api/ps` shows no VRAM, nothing is degraded); the next chat loads it
/// again, runs on the GPU and reports the load in `load_duration`; its keep_alive ("5m") is the
/// one `/api/ps` counts down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ollamas_keep_alive_unloads_the_gpu_copy_and_the_next_chat_loads_it() {
    let api = api(true, None).await;
    wait_for_status(&api, "the GPU worker to be ready", |s| gpu_worker(s)["state"] == "ready").await;
    let ps = api.call("GET", "/api/ps", &[], None).await.json();
    assert!(ps["models"][0]["size_vram"].as_u64().is_some_and(|b| b > 0), "{ps}");
    assert_eq!(ps["models"][0]["expires_at"], "0001-01-01T00:00:00Z", "-1 by default: never unloads");
    let served = |models: &Value| models["data"][0]["headroom"].clone();
    let card = served(&api.call("GET", "/v1/models", &[], None).await.json());
    assert_eq!(card["state"], "gpu", "{card}");
    assert!(card["resident_bytes"]["gpu"].as_u64().is_some_and(|b| b > 0) && card["resident_bytes"]["cpu"].as_u64().is_some_and(|b| b > 0), "{card}");
    assert!(card["last_used_unix_ms"].is_null(), "no request yet: {card}");

    let unload = api.call("POST", "/api/generate", &[], Some(json!({"model": "kjv-demo", "keep_alive": 0}).to_string())).await.json();
    assert_eq!(unload["done_reason"], "unload", "{unload}");
    let status = wait_for_status(&api, "the GPU's copy to unload", |s| s["gpu_residency"]["state"] == "unloaded" && gpu_worker(s)["pid"].is_null()).await;
    assert_eq!(gpu_worker(&status)["state"], "unloaded");
    assert_eq!(status["degraded"], false, "an unloaded model is not degraded: {status}");
    let ps = api.call("GET", "/api/ps", &[], None).await.json();
    assert_eq!(ps["models"][0]["size_vram"], 0, "{ps}");
    let metrics = api.call("GET", "/metrics", &[], None).await.text;
    for line in ["headroom_gpu_model_loaded 0", "headroom_gpu_model_unloads_total 1", "headroom_vram_used_bytes 0"] {
        assert!(metrics.lines().any(|l| l == line), "{line}: {metrics}");
    }
    assert_eq!(ps["models"][0]["headroom"]["gpu_residency"]["state"], "unloaded");
    let card = served(&api.call("GET", "/v1/models", &[], None).await.json());
    assert_eq!(card["state"], "cpu", "only the CPU worker holds it now: {card}");
    assert!(card["resident_bytes"]["gpu"].is_null() && card["resident_bytes"]["cpu"].is_u64(), "{card}");

    let mut body = ollama_chat(4, 1, false);
    body["keep_alive"] = json!("5m");
    let chat = api.call("POST", "/api/chat", &[], Some(body.to_string())).await;
    assert_eq!(chat.status, StatusCode::OK, "{}", chat.text);
    assert_eq!(chat.header("x-headroom-device"), "sim", "it waited for the load on the GPU, not the CPU");
    let chat = chat.json();
    assert_eq!(chat["headroom"]["degraded"], false, "{chat}");
    assert!(chat["load_duration"].as_u64().is_some_and(|ns| ns > 0), "the load is reported: {chat}");
    let ps = api.call("GET", "/api/ps", &[], None).await.json();
    let model = &ps["models"][0];
    assert!(model["size_vram"].as_u64().is_some_and(|b| b > 0), "{ps}");
    assert_eq!(model["headroom"]["gpu_residency"]["keep_alive"], "5m");
    let left = model["headroom"]["gpu_residency"]["unloads_in_ms"].as_u64().expect("a countdown while loaded and idle");
    assert!(left > 200_000 && left <= 300_000, "{left}");
    assert_ne!(model["expires_at"], "0001-01-01T00:00:00Z");
    let metrics = api.call("GET", "/metrics", &[], None).await.text;
    assert!(metrics.lines().any(|l| l == "headroom_gpu_model_loaded 1"), "{metrics}");
    let card = served(&api.call("GET", "/v1/models", &[], None).await.json());
    assert_eq!(card["state"], "gpu", "{card}");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    assert!(card["last_used_unix_ms"].as_u64().is_some_and(|t| t <= now && now - t < 60_000), "{card}");

    // Loaded already: a load call loads nothing.
    let again = api.call("POST", "/api/chat", &[], Some(json!({"model": "kjv-demo", "messages": [], "keep_alive": -1}).to_string())).await.json();
    assert_eq!(again["done_reason"], "load", "{again}");
    let ps = api.call("GET", "/api/ps", &[], None).await.json();
    assert_eq!(ps["models"][0]["expires_at"], "0001-01-01T00:00:00Z", "-1 again: {ps}");
    api.stop().await;
}

/// Bad input to the Ollama routes is a 4xx in Ollama's error shape (`{"error": ...}`) that says
/// what to fix; nothing is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_ollama_input_gets_an_ollama_error_that_says_what_to_fix() {
    let api = api(false, None).await;
    let with = |patch: Value| {
        let mut body = ollama_chat(4, 1, false);
        for (k, v) in patch.as_object().unwrap() {
            body[k] = v.clone();
        }
        body.to_string()
    };
    for (body, status, says) in [
        (with(json!({"model": "llama3.2"})), StatusCode::NOT_FOUND, "this server serves \"kjv-demo\""),
        (with(json!({"format": "json"})), StatusCode::BAD_REQUEST, "format"),
        (with(json!({"options": {"num_predict": 0}})), StatusCode::BAD_REQUEST, "num_predict = 0"),
        (with(json!({"options": {"num_ctx": -5}})), StatusCode::BAD_REQUEST, "num_ctx = -5"),
        (with(json!({"options": {"num_ctx": 1_000_000}})), StatusCode::BAD_REQUEST, "beyond the"),
        (with(json!({"options": {"num_predict": -3}})), StatusCode::BAD_REQUEST, "num_predict = -3"),
        (with(json!({"options": {"temperature": "hot"}})), StatusCode::BAD_REQUEST, "temperature"),
        (with(json!({"options": {"num_ctx": 8, "num_predict": 16}})), StatusCode::BAD_REQUEST, "8"),
        (with(json!({"messages": [{"role": "wizard", "content": "hi"}]})), StatusCode::BAD_REQUEST, "wizard"),
        (with(json!({"messages": [{"role": "user", "content": "look", "images": ["aGk="]}]})), StatusCode::BAD_REQUEST, "text only"),
        (with(json!({"tools": [{"type": "function"}]})), StatusCode::BAD_REQUEST, "/v1/chat/completions"),
        (with(json!({"keep_alive": "soon"})), StatusCode::BAD_REQUEST, "keep_alive \"soon\" is not a duration"),
        (with(json!({"keep_alive": true})), StatusCode::BAD_REQUEST, "keep_alive = true"),
        ("{not json".to_string(), StatusCode::BAD_REQUEST, "invalid request body"),
    ] {
        let r = api.call("POST", "/api/chat", &[], Some(body.clone())).await;
        assert_eq!(r.status, status, "{body}: {}", r.text);
        let error = r.json()["error"].as_str().unwrap_or_else(|| panic!("Ollama's error shape: {}", r.text)).to_string();
        assert!(error.contains(says), "{body}: {error}");
    }
    let r = api.call("POST", "/api/show", &[], Some(json!({"model": "nope"}).to_string())).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert!(r.json()["error"].is_string());
    let s = api.call("GET", "/v1/status", &[], None).await.json();
    let busy: u64 = s["queues"].as_array().unwrap().iter().map(|q| q["running"].as_u64().unwrap_or(0) + q["waiting"].as_u64().unwrap_or(0)).sum();
    assert_eq!(busy, 0, "nothing was accepted: {s}");
    api.stop().await;
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap_or_else(|| panic!("an array of floats: {v}")).iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

/// Embeddings in OpenAI's and Ollama's shapes, through the request path: one vector of the
/// model's width per input, length 1, in input order; the same text gives the same vector in
/// both shapes, alone or in a list, as floats or base64; different texts give different ones.
/// Bad input is a 4xx naming what to fix, and nothing is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_answer_in_openai_and_ollama_shapes() {
    let api = api(false, None).await;
    let width = ModelBundle::open(headroom_model::bundle::resolve_model(headroom_model::bundle::DEMO_MODEL)).unwrap().config.hidden_size;
    let texts = ["In the beginning God created the heaven and the earth.", "Blessed are the meek", "And the LORD spake unto Moses"];
    let one = api.call("POST", "/v1/embeddings", &[], Some(json!({"model": "default", "input": texts[0]}).to_string())).await;
    assert_eq!(one.status, StatusCode::OK, "{}", one.text);
    assert_eq!(one.header("x-headroom-device"), "cpu");
    let body = one.json();
    assert_eq!((body["object"].clone(), body["data"][0]["object"].clone()), (json!("list"), json!("embedding")));
    assert_eq!(body["model"], "kjv-demo");
    assert!(body["usage"]["prompt_tokens"].as_u64().is_some_and(|n| n > 3) && body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"], "{body}");
    assert_eq!(body["data"][0]["headroom"]["device"], "cpu");
    let alone = floats(&body["data"][0]["embedding"]);
    assert_eq!(alone.len(), width, "the model's hidden width");
    let length: f32 = alone.iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!((length - 1.0).abs() < 1e-4, "length {length}");

    let list = api.call("POST", "/v1/embeddings", &[], Some(json!({"model": "kjv-demo", "input": texts}).to_string())).await.json();
    let data = list["data"].as_array().unwrap();
    assert_eq!(data.len(), 3);
    assert!(data.iter().enumerate().all(|(i, d)| d["index"] == i), "{list}");
    let vectors: Vec<Vec<f32>> = data.iter().map(|d| floats(&d["embedding"])).collect();
    assert_eq!(vectors[0], alone, "the same text in a list gives the same vector");
    let cosine = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    assert!(cosine(&vectors[0], &vectors[1]) < 0.999 && cosine(&vectors[1], &vectors[2]) < 0.999, "different texts, different vectors");

    let encoded = api.call("POST", "/v1/embeddings", &[], Some(json!({"model": "default", "input": [texts[0]], "encoding_format": "base64", "dimensions": width}).to_string())).await.json();
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD.decode(encoded["data"][0]["embedding"].as_str().expect("base64 is a string")).unwrap();
    let decoded: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    assert_eq!(decoded, alone, "base64 holds the same little-endian floats");

    let ollama = api.call("POST", "/api/embed", &[], Some(json!({"model": "kjv-demo:latest", "input": [texts[0], texts[1]]}).to_string())).await;
    assert_eq!(ollama.status, StatusCode::OK, "{}", ollama.text);
    let ollama = ollama.json();
    assert_eq!(ollama["model"], "kjv-demo:latest");
    assert_eq!(floats(&ollama["embeddings"][0]), alone);
    assert_eq!(floats(&ollama["embeddings"][1]), vectors[1]);
    assert!(ollama["total_duration"].as_u64().is_some_and(|ns| ns > 0) && ollama["prompt_eval_count"].as_u64().is_some_and(|n| n > 0), "{ollama}");
    assert_eq!(ollama["headroom"][0]["device"], "cpu");
    // A retry with the same Idempotency-Key gets the journal's vectors; nothing runs again.
    let keyed = || api.call("POST", "/v1/embeddings", &[("idempotency-key", "embed-retry")], Some(json!({"model": "default", "input": [texts[0], texts[2]]}).to_string()));
    let (first, again) = (keyed().await.json(), keyed().await.json());
    assert!(first["data"].as_array().unwrap().iter().all(|d| d["headroom"]["from_journal"] == false), "{first}");
    assert!(again["data"].as_array().unwrap().iter().all(|d| d["headroom"]["from_journal"] == true), "the retry is answered from the journal: {again}");
    assert_eq!(floats(&again["data"][1]["embedding"]), vectors[2]);
    let older = api.call("POST", "/api/embeddings", &[], Some(json!({"model": "kjv-demo", "prompt": texts[0]}).to_string())).await.json();
    assert_eq!(floats(&older["embedding"]), alone, "Ollama's older route: {older}");

    // More inputs than the CPU queue holds (16): they go through a window, in order.
    let many: Vec<String> = (0..40).map(|i| format!("And the {i}th day")).collect();
    let reply = api.call("POST", "/v1/embeddings", &[], Some(json!({"model": "default", "input": many}).to_string())).await;
    assert_eq!(reply.status, StatusCode::OK, "a list longer than the queue: {}", reply.text);
    let data = reply.json()["data"].as_array().unwrap().clone();
    assert!(data.len() == 40 && data.iter().enumerate().all(|(i, d)| d["index"] == i), "40 in order");

    let long = "And it came to pass ".repeat(2000);
    let truncated = api.call("POST", "/api/embed", &[], Some(json!({"model": "kjv-demo", "input": long, "truncate": true}).to_string())).await;
    assert_eq!(truncated.status, StatusCode::OK, "Ollama's truncate: true, when sent, cuts: {}", truncated.text);
    let context = api.call("POST", "/api/show", &[], Some(json!({"model": "kjv-demo"}).to_string())).await.json()["model_info"]["llama.context_length"].as_u64().unwrap();
    for (path, body, status, says) in [
        ("/v1/embeddings", json!({"model": "default", "input": ""}), StatusCode::BAD_REQUEST, "input is empty"),
        ("/v1/embeddings", json!({"model": "default", "input": ["hi", " "]}), StatusCode::BAD_REQUEST, "input[1] is empty"),
        ("/v1/embeddings", json!({"model": "default", "input": []}), StatusCode::BAD_REQUEST, "empty array"),
        ("/v1/embeddings", json!({"model": "default", "input": [1, 2, 3]}), StatusCode::BAD_REQUEST, "token ids"),
        ("/v1/embeddings", json!({"model": "default", "input": [[1, 2], [3]]}), StatusCode::BAD_REQUEST, "token ids"),
        ("/v1/embeddings", json!({"model": "default", "input": {"text": "hi"}}), StatusCode::BAD_REQUEST, "a string or an array of strings"),
        ("/v1/embeddings", json!({"model": "default", "input": long}), StatusCode::BAD_REQUEST, &format!("embeds at most {context} tokens")),
        ("/v1/embeddings", json!({"model": "default", "input": "hi", "encoding_format": "int8"}), StatusCode::BAD_REQUEST, "encoding_format"),
        ("/v1/embeddings", json!({"model": "default", "input": "hi", "dimensions": 3}), StatusCode::BAD_REQUEST, &format!("have {width}")),
        ("/v1/embeddings", json!({"model": "text-embedding-3-small", "input": "hi"}), StatusCode::NOT_FOUND, "not served here"),
        ("/api/embed", json!({"model": "kjv-demo", "input": long}), StatusCode::BAD_REQUEST, "embeds at most"),
        ("/api/embed", json!({"model": "kjv-demo"}), StatusCode::BAD_REQUEST, "input is required"),
        ("/api/embed", json!({"model": "kjv-demo", "input": "hi", "dimensions": 7}), StatusCode::BAD_REQUEST, &format!("have {width}")),
        ("/api/embed", json!({"model": "nomic-embed-text", "input": "hi"}), StatusCode::NOT_FOUND, "not found"),
        ("/api/embeddings", json!({"model": "kjv-demo", "prompt": ""}), StatusCode::BAD_REQUEST, "prompt is empty"),
        ("/api/embeddings", json!({"model": "kjv-demo"}), StatusCode::BAD_REQUEST, "prompt is required"),
    ] {
        let r = api.call("POST", path, &[], Some(body.to_string())).await;
        assert_eq!(r.status, status, "{path} {body}: {}", r.text);
        let json = r.json();
        let error = json["error"]["message"].as_str().or(json["error"].as_str()).unwrap_or_else(|| panic!("an error body: {}", r.text)).to_string();
        assert!(error.contains(says), "{path} {body}: {error}");
    }
    let s = api.call("GET", "/v1/status", &[], None).await.json();
    let busy: u64 = s["queues"].as_array().unwrap().iter().map(|q| q["running"].as_u64().unwrap_or(0) + q["waiting"].as_u64().unwrap_or(0)).sum();
    assert_eq!(busy, 0, "nothing was accepted: {s}");
    api.stop().await;
}

/// Its negative control: with every input of a list submitted at once, a list longer than the
/// CPU queue is refused.
#[test]
fn the_embeddings_list_check_fails_when_every_input_is_submitted_at_once() {
    headroom_model::assert_control_fails("embeddings_answer_in_openai_and_ollama_shapes", "embed-all-at-once", "a list longer than the queue");
}

/// An Ollama stream whose GPU runs out of memory mid-answer finishes on the CPU: every line
/// arrives, the last says done with the failover in its `headroom` object, and the text is the
/// one the GPU alone gives for the same seed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ollama_stream_fails_over_mid_answer_and_finishes() {
    let api = api(true, None).await;
    let healthy = api.call("POST", "/api/chat", &[], Some(ollama_chat(16, 3, true).to_string())).await;
    let lines = ndjson(&healthy);
    assert_eq!(lines.last().unwrap()["headroom"]["device"], "sim", "{}", healthy.text);
    let expected: String = lines.iter().filter_map(|l| l["message"]["content"].as_str()).collect();
    let r = api.call("POST", "/admin/sim/fault", &[], Some(json!({"fault": "oom_after_tokens", "tokens": 4}).to_string())).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let failed = api.call("POST", "/api/chat", &[], Some(ollama_chat(16, 3, true).to_string())).await;
    assert_eq!(failed.status, StatusCode::OK);
    let lines = ndjson(&failed);
    let last = lines.last().unwrap();
    assert_eq!(last["done"], true, "{}", failed.text);
    assert_eq!(last["headroom"]["failovers"][0]["from"], "sim", "{last}");
    assert_eq!(last["headroom"]["device"], "cpu");
    let text: String = lines.iter().filter_map(|l| l["message"]["content"].as_str()).collect();
    assert_eq!(text, expected, "resumed on the CPU without a repeated or lost token");
    api.stop().await;
}

/// Its negative control: a stream that ends where the request changes device (as a server
/// without failover ends it) fails the test.
#[test]
fn the_ollama_failover_check_fails_when_the_stream_ends_at_the_failover() {
    headroom_model::assert_control_fails("an_ollama_stream_fails_over_mid_answer_and_finishes", "ollama-stream-ends-at-failover", "the GPU failed mid-answer");
}
