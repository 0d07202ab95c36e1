//! The tray icon (its colour follows degraded mode and the GPU pause; menu: open, pause GPU, quit)
//! and the desktop notifications on entering and leaving degraded mode. Both are optional comforts: a desktop with
//! no tray library or no D-Bus session gets a warning in the log, never a crash.

use std::panic::{catch_unwind, AssertUnwindSafe};

use futures_util::StreamExt;
use tauri::image::Image;
use tauri::menu::{CheckMenuItem, Menu, MenuItem};
use tauri::tray::{TrayIcon, TrayIconBuilder};
use tauri::{AppHandle, Manager};
use tauri_plugin_notification::NotificationExt;

use crate::ipc::Shell;

const HEALTHY: [u8; 3] = [46, 139, 87];
const DEGRADED: [u8; 3] = [230, 150, 20];
const PAUSED: [u8; 3] = [120, 120, 130];

/// A filled circle, so the tray needs no image files.
fn dot(rgb: [u8; 3]) -> Image<'static> {
    const SIZE: u32 = 32;
    let mut rgba = Vec::with_capacity((SIZE * SIZE * 4) as usize);
    let c = (SIZE as f32 - 1.0) / 2.0;
    for y in 0..SIZE {
        for x in 0..SIZE {
            let inside = ((x as f32 - c).powi(2) + (y as f32 - c).powi(2)).sqrt() <= SIZE as f32 * 0.42;
            rgba.extend_from_slice(&[rgb[0], rgb[1], rgb[2], if inside { 255 } else { 0 }]);
        }
    }
    Image::new_owned(rgba, SIZE, SIZE)
}

struct Tray {
    icon: TrayIcon,
    pause_gpu: CheckMenuItem<tauri::Wry>,
}

fn build_tray(app: &AppHandle, shell: &Shell) -> tauri::Result<Tray> {
    let open = MenuItem::with_id(app, "open", "Open Headroom", true, None::<&str>)?;
    // Enabled once the status says there is a GPU to pause.
    let pause_gpu = CheckMenuItem::with_id(app, "pause_gpu", "Pause GPU", false, false, None::<&str>)?;
    let quit = MenuItem::with_id(app, "quit", "Quit", true, None::<&str>)?;
    let menu = Menu::with_items(app, &[&open, &pause_gpu, &quit])?;
    let shell = shell.clone();
    let toggle = pause_gpu.clone();
    let icon = TrayIconBuilder::with_id("headroom")
        .icon(dot(HEALTHY))
        .tooltip("Headroom: GPU healthy")
        .menu(&menu)
        .on_menu_event(move |app, event| match event.id().as_ref() {
            "open" => {
                if let Some(window) = app.get_webview_window("main") {
                    let _ = window.show();
                    let _ = window.set_focus();
                }
            }
            "pause_gpu" => {
                // The menu has already flipped the check mark; make the setting match it. The
                // settings event then confirms it (or a failed change puts the mark back).
                let paused = toggle.is_checked().unwrap_or(false);
                let shell = shell.clone();
                let toggle = toggle.clone();
                tauri::async_runtime::spawn(async move {
                    let patch = serde_json::json!({ "gpu_paused": paused }).to_string();
                    if let Err(e) = crate::ipc::update_settings_text(&shell, patch, None).await {
                        tracing::warn!("cannot pause or resume the GPU: {e}");
                        let _ = toggle.set_checked(!paused);
                    }
                });
            }
            "quit" => app.exit(0),
            _ => {}
        })
        .build(app)?;
    Ok(Tray { icon, pause_gpu })
}

/// Shows the tray icon (when the desktop has a tray) and follows degraded mode for it and for
/// notifications.
pub fn install(app: &AppHandle, shell: Shell) {
    // libappindicator is loaded at run time and panics when it is missing.
    let tray = match catch_unwind(AssertUnwindSafe(|| build_tray(app, &shell))) {
        Ok(Ok(tray)) => Some(tray),
        Ok(Err(e)) => {
            tracing::warn!("no tray icon: {e}");
            None
        }
        Err(_) => {
            tracing::warn!("no tray icon: the tray library (libayatana-appindicator3) is not available");
            None
        }
    };
    let app = app.clone();
    tauri::async_runtime::spawn(async move {
        if let Err(e) = follow_degraded(&app, tray.as_ref(), &shell).await {
            tracing::warn!("degraded-mode notifications stopped: {e}");
        }
    });
}

/// Sets the icon and tooltip for where the service stands; `layers` (see [`layers_note`]) says
/// where a healthy GPU's model runs.
fn show_state(tray: &Tray, degraded: bool, paused: bool, reason: &str, layers: &str) {
    let (rgb, tip) = match (degraded, paused) {
        (true, _) if reason.is_empty() => (DEGRADED, "Headroom: degraded; serving from the CPU".to_string()),
        (true, _) => (DEGRADED, format!("Headroom: {reason}")),
        (false, true) => (PAUSED, "Headroom: GPU paused; serving from the CPU".to_string()),
        (false, false) if layers.is_empty() => (HEALTHY, "Headroom: GPU healthy".to_string()),
        (false, false) => (HEALTHY, format!("Headroom: GPU healthy; {layers}")),
    };
    let _ = tray.icon.set_icon(Some(dot(rgb)));
    let _ = tray.icon.set_tooltip(Some(tip));
    let _ = tray.pause_gpu.set_checked(paused);
}

/// "split: 22 of 32 layers on the GPU, up to 41 tokens/s" for a split model (the `placement`
/// of `/v1/status`); empty when every layer runs on one device.
fn layers_note(placement: &serde_json::Value) -> String {
    let (Some(gpu), Some(all)) = (placement["gpu_layers"].as_u64(), placement["layers"].as_u64()) else { return String::new() };
    if gpu == 0 || gpu == all {
        return String::new();
    }
    match placement["predicted_decode_tok_s"].as_f64() {
        Some(speed) => format!("split: {gpu} of {all} layers on the GPU, up to {speed:.0} tokens/s"),
        None => format!("split: {gpu} of {all} layers on the GPU"),
    }
}

async fn follow_degraded(app: &AppHandle, tray: Option<&Tray>, shell: &Shell) -> Result<(), String> {
    let response = shell.call("GET", "/v1/events", None).await?;
    let mut body = response.into_body().into_data_stream();
    let mut buffer = Vec::new();
    // The models in degraded mode, with what the person is told (kept for the tooltip's redraws).
    let mut degraded = DegradedModels::default();
    let mut paused = false;
    let mut layers = String::new();
    let mut first_model = String::new();
    while let Some(chunk) = body.next().await {
        buffer.extend_from_slice(&chunk.map_err(|e| e.to_string())?);
        for data in headroom_server::sse::complete_sse_data(&mut buffer) {
            let Ok(event) = serde_json::from_str::<serde_json::Value>(&data) else { continue };
            // The GPU pause is the person's choice: icon and menu follow it, no notification.
            let paused_now = match event["event"].as_str() {
                Some("gpu_paused") => event["paused"].as_bool(),
                // A restart placed the layers again (more or less VRAM free); the tooltip speaks
                // of the first model (the one the status body describes), not of the others.
                Some("placement_changed") if event["model"].as_str().is_none_or(|m| m == first_model) => {
                    layers = layers_note(&event);
                    if let Some(tray) = tray {
                        show_state(tray, degraded.any(), paused, &degraded.words(), &layers);
                    }
                    None
                }
                None => {
                    first_model = event["model"].as_str().unwrap_or("").to_string();
                    let has_gpu = event["workers"].as_array().is_some_and(|w| w.iter().any(|w| w["kind"] == "gpu"));
                    layers = layers_note(&event["placement"]);
                    if let Some(tray) = tray {
                        let _ = tray.pause_gpu.set_enabled(has_gpu);
                        show_state(tray, degraded.any(), paused, &degraded.words(), &layers);
                    }
                    event["gpu_paused"].as_bool()
                }
                _ => None,
            };
            if let Some(now) = paused_now.filter(|p| *p != paused) {
                paused = now;
                if let Some(tray) = tray {
                    show_state(tray, degraded.any(), paused, &degraded.words(), &layers);
                }
            }
            // The first event is the status body (no `event` field), saying where each model
            // stands; `degraded` events say when one model's changes.
            let turns = degraded.follow(&event);
            if turns.is_empty() {
                continue;
            }
            if let Some(tray) = tray {
                show_state(tray, degraded.any(), paused, &degraded.words(), &layers);
            }
            for turn in turns {
                let title = degraded.title(&turn);
                let shown = catch_unwind(AssertUnwindSafe(|| app.notification().builder().title(&title).body(&turn.words).show()));
                match shown {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::warn!("notification not shown: {e}"),
                    Err(_) => tracing::warn!("notification not shown: the notification service failed"),
                }
            }
        }
    }
    Ok(())
}

/// The served models in degraded mode now, each with the words a person reads about it. Several
/// models may share the GPU: the tray is degraded while any of them is, and names which. An
/// eviction or a keep_alive unload is no degradation (no `degraded` event); a redirect is.
#[derive(Default)]
struct DegradedModels {
    models: std::collections::BTreeMap<String, String>,
    several: bool,
}

/// One model entering or leaving degraded mode, and what it is told.
#[derive(Debug, PartialEq)]
struct Turn {
    model: String,
    degraded: bool,
    words: String,
}

impl DegradedModels {
    /// Takes in a status body (every model's state: the stream's first event) or a `degraded`
    /// event (one model's change); returns the models whose state turned.
    fn follow(&mut self, event: &serde_json::Value) -> Vec<Turn> {
        let mut seen = Vec::new();
        let listed = event["models"].as_array().filter(|m| event.get("event").is_none() && m.iter().all(|m| m.get("degraded").is_some()));
        match listed {
            Some(models) if !models.is_empty() => {
                self.several = models.len() > 1;
                for m in models {
                    let words = m["degraded_summary"].as_str().unwrap_or("").to_string();
                    seen.push((m["id"].as_str().unwrap_or("").to_string(), m["degraded"].as_bool().unwrap_or(false), words));
                }
            }
            _ => {
                let Some((now, words)) = degraded_words(event) else { return Vec::new() };
                seen.push((event["model"].as_str().unwrap_or("").to_string(), now, words));
            }
        }
        seen.into_iter()
            .filter_map(|(model, now, words)| {
                let was = if now { self.models.insert(model.clone(), words.clone()).is_some() } else { self.models.remove(&model).is_some() };
                (was != now).then_some(Turn { model, degraded: now, words })
            })
            .collect()
    }

    fn any(&self) -> bool {
        !self.models.is_empty()
    }

    /// The tooltip's words: the one model's summary, or each degraded model's, named.
    fn words(&self) -> String {
        if !self.several {
            return self.models.values().next().cloned().unwrap_or_default();
        }
        let named: Vec<String> = self.models.iter().map(|(m, w)| if w.is_empty() { format!("{m} degraded") } else { format!("{m}: {w}") }).collect();
        named.join("; ")
    }

    /// A notification's title for a turn: with several models, it names the model.
    fn title(&self, turn: &Turn) -> String {
        match (turn.degraded, self.several) {
            (true, false) => "Headroom: serving from the CPU".into(),
            (false, false) => "Headroom: GPU restored".into(),
            (true, true) => format!("Headroom: serving {} from the CPU", turn.model),
            (false, true) => format!("Headroom: GPU restored for {}", turn.model),
        }
    }
}

/// Whether a status body or `degraded` event says the service is degraded, and the words a
/// person reads about it: the plain summary where the server gave one, else its reason.
fn degraded_words(event: &serde_json::Value) -> Option<(bool, String)> {
    let (summary, reason) = match event["event"].as_str() {
        Some("degraded") => ("summary", "reason"),
        None if event.get("degraded").is_some() => ("degraded_summary", "degraded_reason"),
        _ => return None,
    };
    let words = event[summary].as_str().or_else(|| event[reason].as_str()).unwrap_or("");
    Some((event["degraded"].as_bool().unwrap_or(false), words.to_string()))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn the_tooltip_names_a_split_and_its_speed() {
        let split = json!({"gpu_layers": 22, "layers": 32, "predicted_decode_tok_s": 40.6});
        assert_eq!(super::layers_note(&split), "split: 22 of 32 layers on the GPU, up to 41 tokens/s");
        assert_eq!(super::layers_note(&json!({"gpu_layers": 22, "layers": 32})), "split: 22 of 32 layers on the GPU");
        assert_eq!(super::layers_note(&json!({"gpu_layers": 32, "layers": 32})), "");
        assert_eq!(super::layers_note(&serde_json::Value::Null), "");
    }

    #[test]
    fn the_notice_reads_the_plain_summary_first() {
        let event = json!({"event": "degraded", "degraded": true, "reason": "GPU unavailable: 3 allocation failures", "summary": "The GPU is out of memory; kjv-demo on the CPU is answering."});
        assert_eq!(super::degraded_words(&event), Some((true, "The GPU is out of memory; kjv-demo on the CPU is answering.".into())));
        let restored = json!({"event": "degraded", "degraded": false, "reason": "GPU restored: probe succeeded"});
        assert_eq!(super::degraded_words(&restored), Some((false, "GPU restored: probe succeeded".into())));
        let status = json!({"degraded": true, "degraded_reason": "r", "degraded_summary": "s"});
        assert_eq!(super::degraded_words(&status), Some((true, "s".into())));
        assert_eq!(super::degraded_words(&json!({"event": "failover"})), None);
    }

    #[test]
    fn the_tray_stays_degraded_while_any_model_is() {
        let mut d = super::DegradedModels::default();
        let status = json!({"model": "a", "degraded": false, "models": [
            {"id": "a", "degraded": false, "degraded_summary": null},
            {"id": "b", "degraded": true, "degraded_summary": "b's GPU is out of memory; b on the CPU is answering."},
        ]});
        let turns = d.follow(&status);
        assert_eq!(turns, vec![super::Turn { model: "b".into(), degraded: true, words: "b's GPU is out of memory; b on the CPU is answering.".into() }]);
        assert!(d.any());
        assert_eq!(d.title(&turns[0]), "Headroom: serving b from the CPU");
        // Another model's recovery does not clear b's degradation (one flag for all did).
        assert!(d.follow(&json!({"event": "degraded", "model": "a", "degraded": false, "reason": "GPU restored"})).is_empty());
        assert!(d.any());
        assert_eq!(d.words(), "b: b's GPU is out of memory; b on the CPU is answering.");
        let a_down = d.follow(&json!({"event": "degraded", "model": "a", "degraded": true, "summary": "a on the CPU"}));
        assert_eq!(a_down.len(), 1);
        assert_eq!(d.words(), "a: a on the CPU; b: b's GPU is out of memory; b on the CPU is answering.");
        d.follow(&json!({"event": "degraded", "model": "b", "degraded": false, "reason": "GPU restored: probe succeeded"}));
        assert!(d.any(), "a is still degraded");
        let back = d.follow(&json!({"event": "degraded", "model": "a", "degraded": false, "reason": "GPU restored: probe succeeded"}));
        assert_eq!(d.title(&back[0]), "Headroom: GPU restored for a");
        assert!(!d.any());
        // An eviction is no degradation.
        assert!(d.follow(&json!({"event": "gpu_model_unloaded", "model": "a", "reason": "evicted"})).is_empty());
    }

    #[test]
    fn one_model_reads_as_before() {
        let mut d = super::DegradedModels::default();
        assert!(d.follow(&json!({"model": "a", "degraded": false, "models": [{"id": "a", "degraded": false}]})).is_empty());
        let turn = d.follow(&json!({"event": "degraded", "model": "a", "degraded": true, "reason": "r", "summary": "s"}));
        assert_eq!(d.title(&turn[0]), "Headroom: serving from the CPU");
        assert_eq!(d.words(), "s");
    }
}
