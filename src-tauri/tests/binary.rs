//! The app's binary as the desktop end-to-end test and the supervisor run it. Building this test
//! makes `cargo test` build `target/debug/headroom-desktop` in the same build as everything else
//! (the end-to-end test then drives that binary; `npm run tauri:build` produces the same one).

use std::process::Command;

fn app() -> Command {
    Command::new(env!("CARGO_BIN_EXE_headroom-desktop"))
}

#[test]
fn the_app_takes_the_servers_options() {
    let out = app().arg("--help").output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let help = String::from_utf8_lossy(&out.stdout);
    for option in ["--gpu", "--model", "--port", "--data-dir"] {
        assert!(help.contains(option), "{option} missing from:\n{help}");
    }
}

/// The supervisor spawns the app's own executable as `worker`: a bad device is refused with the
/// devices it knows, before anything loads.
#[test]
fn the_app_runs_as_a_worker_and_refuses_an_unknown_device() {
    let out = app().args(["worker", "--device", "tpu"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown device") && err.contains("cuda:N"), "{err}");
}
