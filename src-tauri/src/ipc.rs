//! The typed IPC commands the window's UI calls (`ui/src/client.ts`, `TauriTransport`). Each one
//! calls the embedded server's own routes in-process, so the desktop app and the browser get the
//! same semantics from one implementation. Streams (a chat reply, the service events) come back
//! through a Tauri `Channel` as the server's SSE text, which the UI folds with the same code as
//! over HTTP; hanging a stream up drops its body, which the server treats as a client hang-up.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use futures_util::StreamExt;
use headroom_service::Running;
use serde::{Deserialize, Serialize};
use specta::Type;
use tauri::ipc::Channel;
use tauri::State;
use tower::ServiceExt;

/// The shell's shared state: the server once it runs, and the open streams' hang-up switches.
#[derive(Clone)]
pub struct Shell {
    running: tokio::sync::watch::Sender<Option<Running>>,
    streams: Arc<Mutex<HashMap<u32, tokio::sync::oneshot::Sender<()>>>>,
}

impl Shell {
    pub fn new() -> Self {
        Self { running: tokio::sync::watch::channel(None).0, streams: Arc::default() }
    }

    pub fn ready(&self, running: Running) {
        println!("headroom-desktop: API and web UI at http://{}", running.addr);
        self.running.send_replace(Some(running));
    }

    /// The server, waiting for it while it starts (loading the model takes a moment).
    pub async fn server(&self) -> Result<Running, String> {
        let mut rx = self.running.subscribe();
        let running = tokio::time::timeout(std::time::Duration::from_secs(600), rx.wait_for(Option::is_some))
            .await
            .map_err(|_| "the embedded server did not start within 10 minutes; see the log".to_string())?
            .map_err(|_| "the embedded server stopped".to_string())?;
        Ok(running.clone().expect("waited for Some"))
    }

    /// Calls one of the server's routes in-process.
    pub async fn call(&self, method: &str, path: &str, body: Option<String>) -> Result<axum::response::Response, String> {
        let app = self.server().await?.app;
        let request = axum::http::Request::builder()
            .method(method)
            .uri(path)
            .header("content-type", "application/json")
            .body(body.map(Body::from).unwrap_or_else(Body::empty))
            .map_err(|e| e.to_string())?;
        app.oneshot(request).await.map_err(|e| e.to_string())
    }

    /// Sends a response's body through `channel` as text until it ends, the receiver goes away, or
    /// `stream_id` is hung up.
    async fn pump(&self, response: axum::response::Response, stream_id: u32, channel: &Channel<StreamFrame>) {
        let (hang_up_tx, mut hang_up) = tokio::sync::oneshot::channel();
        self.streams.lock().unwrap().insert(stream_id, hang_up_tx);
        let mut body = response.into_body().into_data_stream();
        loop {
            tokio::select! {
                _ = &mut hang_up => break,
                chunk = body.next() => match chunk {
                    Some(Ok(bytes)) => {
                        let text = String::from_utf8_lossy(&bytes).into_owned();
                        if channel.send(StreamFrame::Body { text }).is_err() {
                            break;
                        }
                    }
                    Some(Err(e)) => {
                        let _ = channel.send(StreamFrame::Failed { message: e.to_string() });
                        break;
                    }
                    None => break,
                },
            }
        }
        self.streams.lock().unwrap().remove(&stream_id);
        let _ = channel.send(StreamFrame::End);
    }
}

/// One frame of a streamed response.
#[derive(Serialize, Type, Clone)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StreamFrame {
    /// The response's status and the headers the UI shows.
    Head {
        status: u16,
        device: Option<String>,
        request_id: Option<String>,
        estimated_delay_ms: Option<f64>,
        /// The error body of a response that is not a stream.
        error: Option<String>,
    },
    /// Server-sent event text, in arbitrary pieces.
    Body { text: String },
    Failed { message: String },
    End,
}

#[derive(Deserialize, Type)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

#[derive(Deserialize, Type)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    pub max_tokens: u32,
    pub temperature: f32,
}

fn header(response: &axum::response::Response, name: &str) -> Option<String> {
    response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string)
}

async fn json_of(response: axum::response::Response) -> Result<serde_json::Value, String> {
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), 16 << 20).await.map_err(|e| e.to_string())?;
    let value: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
    if !status.is_success() {
        return Err(value["error"]["message"].as_str().map(str::to_string).unwrap_or_else(|| format!("HTTP {status}")));
    }
    Ok(value)
}

/// The service's status: the body of `GET /v1/status`, as JSON text (its numbers include byte
/// counts beyond what specta exports as TypeScript numbers; the UI parses it as the browser does).
#[tauri::command]
#[specta::specta]
pub async fn status(shell: State<'_, Shell>) -> Result<String, String> {
    json_of(shell.call("GET", "/v1/status", None).await?).await.map(|v| v.to_string())
}

/// Streams a chat completion (`POST /v1/chat/completions`, `stream: true`) through `on_frame`.
#[tauri::command]
#[specta::specta]
pub async fn chat(
    shell: State<'_, Shell>,
    request: ChatRequest,
    stream_id: u32,
    on_frame: Channel<StreamFrame>,
) -> Result<(), String> {
    let messages: Vec<serde_json::Value> = request
        .messages
        .iter()
        .map(|m| serde_json::json!({ "role": m.role, "content": m.content }))
        .collect();
    let body = serde_json::json!({
        "model": "default",
        "messages": messages,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "stream": true,
    });
    let response = shell.call("POST", "/v1/chat/completions", Some(body.to_string())).await?;
    let status = response.status().as_u16();
    let device = header(&response, "x-headroom-device");
    let request_id = header(&response, "x-request-id");
    let estimated_delay_ms = header(&response, "x-headroom-estimated-delay-ms").and_then(|d| d.parse().ok());
    if !response.status().is_success() {
        // Not a stream: the head carries the error body's message, and that is all.
        let error = json_of(response).await.err();
        let _ = on_frame.send(StreamFrame::Head { status, device, request_id, estimated_delay_ms, error });
        let _ = on_frame.send(StreamFrame::End);
        return Ok(());
    }
    on_frame.send(StreamFrame::Head { status, device, request_id, estimated_delay_ms, error: None }).map_err(|e| e.to_string())?;
    shell.pump(response, stream_id, &on_frame).await;
    Ok(())
}

/// Follows the service events (`GET /v1/events`) through `on_frame` until hung up.
#[tauri::command]
#[specta::specta]
pub async fn events(shell: State<'_, Shell>, stream_id: u32, on_frame: Channel<StreamFrame>) -> Result<(), String> {
    let response = shell.call("GET", "/v1/events", None).await?;
    shell.pump(response, stream_id, &on_frame).await;
    Ok(())
}

/// Hangs up a stream started by `chat` or `events` (a chat hung up is cancelled by the server).
#[tauri::command]
#[specta::specta]
pub fn hang_up(shell: State<'_, Shell>, stream_id: u32) {
    if let Some(stop) = shell.streams.lock().unwrap().remove(&stream_id) {
        let _ = stop.send(());
    }
}

/// Cancels a request by id (`POST /v1/requests/{id}/cancel`), queued or running.
#[tauri::command]
#[specta::specta]
pub async fn cancel(shell: State<'_, Shell>, request_id: String) -> Result<(), String> {
    let path = format!("/v1/requests/{}/cancel", request_id.replace(|c: char| !c.is_ascii_alphanumeric() && c != '_' && c != '-', ""));
    json_of(shell.call("POST", &path, None).await?).await.map(|_| ())
}

/// The settings in force: the body of `GET /v1/settings`, as JSON text (MiB values are u64);
/// `model` names a served model (its fallback model and layer count), default the first.
#[tauri::command]
#[specta::specta]
pub async fn settings(shell: State<'_, Shell>, model: Option<String>) -> Result<String, String> {
    json_of(shell.call("GET", &settings_path(model.as_deref()), None).await?).await.map(|v| v.to_string())
}

/// `/v1/settings`, with `?model=` (percent-encoded) when a model is named.
fn settings_path(model: Option<&str>) -> String {
    let Some(model) = model else { return "/v1/settings".into() };
    let encoded: String = model.bytes().map(|b| if b.is_ascii_alphanumeric() || b"-._~".contains(&b) { (b as char).to_string() } else { format!("%{b:02X}") }).collect();
    format!("/v1/settings?model={encoded}")
}

/// Changes settings (`PATCH /v1/settings` with `patch`, a JSON merge patch as text; `model`
/// names whose fallback model and layer count change, default the first); returns the response
/// body as JSON text, or the server's error message.
#[tauri::command]
#[specta::specta]
pub async fn update_settings(shell: State<'_, Shell>, patch: String, model: Option<String>) -> Result<String, String> {
    update_settings_text(&shell, patch, model.as_deref()).await
}

/// `PATCH /v1/settings` in-process (the command, and the tray's "Pause GPU", which names no
/// model: the pause is the service's).
pub async fn update_settings_text(shell: &Shell, patch: String, model: Option<&str>) -> Result<String, String> {
    json_of(shell.call("PATCH", &settings_path(model), Some(patch)).await?).await.map(|v| v.to_string())
}

/// Where the HTTP API listens, for other programs (the desktop app serves them too).
#[tauri::command]
#[specta::specta]
pub async fn api_address(shell: State<'_, Shell>) -> Result<String, String> {
    Ok(format!("http://{}", shell.server().await?.addr))
}

pub fn builder() -> tauri_specta::Builder<tauri::Wry> {
    tauri_specta::Builder::<tauri::Wry>::new().commands(tauri_specta::collect_commands![status, chat, events, hang_up, cancel, settings, update_settings, api_address])
}

pub fn default_bindings_path() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../ui/src/bindings.ts"))
}

/// Writes the TypeScript bindings of the commands (committed as `ui/src/bindings.ts`).
pub fn export_bindings(path: &Path) -> anyhow::Result<()> {
    builder()
        .export(specta_typescript::Typescript::default().header("// Generated by `headroom-desktop export-bindings`; do not edit.\n"), path)
        .map_err(|e| anyhow::anyhow!("cannot write the bindings to {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    /// The committed bindings are what the commands export now: regenerate and compare.
    #[test]
    fn committed_bindings_are_current() {
        let dir = std::env::temp_dir().join(format!("headroom-bindings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fresh = dir.join("bindings.ts");
        super::export_bindings(&fresh).unwrap();
        let committed = std::fs::read_to_string(super::default_bindings_path()).unwrap_or_default();
        let fresh = std::fs::read_to_string(&fresh).unwrap();
        assert!(
            committed == fresh,
            "ui/src/bindings.ts is stale: run `cargo run -p headroom-desktop -- export-bindings` and commit it"
        );
    }
}
