//! Headroom's desktop app: a thin Tauri 2 shell. It runs the same router and HTTP server as
//! `headroom serve`, in this process, on the one tokio runtime Tauri also uses. The window's UI
//! reaches the server through typed IPC commands (tauri-specta bindings in `ui/src/bindings.ts`)
//! that call the server's routes in-process; other programs still use the HTTP API.
//!
//! The supervisor spawns this same executable as `headroom-desktop worker ...` for the GPU and CPU
//! workers, exactly as it spawns `headroom worker`.

#![cfg_attr(all(not(debug_assertions), target_os = "windows"), windows_subsystem = "windows")]

mod ipc;
mod tray;

use std::ffi::OsString;

use clap::Parser;
use headroom_service::{ServeOptions, WorkerArgs};
use tauri::Manager;

#[derive(Parser)]
#[command(name = "headroom-desktop", about = "Headroom's desktop app (the server's options apply)")]
struct DesktopArgs {
    #[command(flatten)]
    serve: ServeOptions,
}

/// `headroom-desktop worker ...`, as the supervisor spawns it.
#[derive(Parser)]
struct DesktopWorker {
    #[command(subcommand)]
    command: WorkerCommand,
}

#[derive(clap::Subcommand)]
enum WorkerCommand {
    Worker(WorkerArgs),
}

fn main() {
    let args: Vec<OsString> = std::env::args_os().collect();
    match args.get(1).and_then(|a| a.to_str()) {
        // The supervisor's workers run as in the CLI.
        Some("worker") => {
            headroom_service::init_logging();
            let DesktopWorker { command: WorkerCommand::Worker(worker) } = DesktopWorker::parse_from(&args);
            match headroom_service::run_worker(worker) {
                Ok(code) => std::process::exit(code),
                Err(e) => exit_on_error(Err(e)),
            }
        }
        Some("export-bindings") => {
            let path = args.get(2).map(std::path::PathBuf::from).unwrap_or_else(ipc::default_bindings_path);
            exit_on_error(ipc::export_bindings(&path));
        }
        _ => {
            let mut desktop = DesktopArgs::parse_from(&args);
            // The desktop app's API listens on a free port unless one is asked for, so it never
            // fights a `headroom serve` already on 8080.
            desktop.serve.port.get_or_insert(0);
            run_app(desktop.serve);
        }
    }
}

fn exit_on_error(result: anyhow::Result<()>) {
    if let Err(e) = result {
        eprintln!("headroom-desktop: {e:#}");
        std::process::exit(1);
    }
}

fn run_app(serve: ServeOptions) {
    headroom_service::init_logging();
    // One runtime for the server and for Tauri's async commands.
    let runtime = tokio::runtime::Runtime::new().expect("cannot start the tokio runtime");
    tauri::async_runtime::set(runtime.handle().clone());
    let shell = ipc::Shell::new();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = {
        let shell = shell.clone();
        runtime.spawn(async move {
            let result = headroom_service::run(
                serve,
                move |running| shell.ready(running),
                async move {
                    let _ = stop_rx.await;
                },
            )
            .await;
            if let Err(e) = &result {
                eprintln!("headroom-desktop: the server stopped: {e:#}");
            }
            result
        })
    };

    let bindings = ipc::builder();
    let app = tauri::Builder::default()
        .plugin(tauri_plugin_notification::init())
        .manage(shell.clone())
        .invoke_handler(bindings.invoke_handler())
        .setup(move |app| {
            bindings.mount_events(app);
            tray::install(app.handle(), shell.clone());
            Ok(())
        })
        .build(tauri::generate_context!())
        .expect("cannot build the Tauri app");
    let mut stop_tx = Some(stop_tx);
    app.run(move |handle, event| {
        if let tauri::RunEvent::ExitRequested { .. } = event {
            if let Some(stop) = stop_tx.take() {
                let _ = stop.send(());
            }
            // Let running requests finish (the server's own grace period), then stop the workers.
            if let Some(window) = handle.get_webview_window("main") {
                let _ = window.hide();
            }
        }
    });
    let _ = runtime.block_on(server);
}
