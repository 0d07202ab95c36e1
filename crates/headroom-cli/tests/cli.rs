//! The `headroom` binary end to end: generate on the embedded model, device errors, plan.

use std::process::Command;

fn headroom() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_headroom"));
    cmd.env_remove("HEADROOM_CONFIG");
    cmd
}

#[test]
fn generate_streams_text_from_the_embedded_model() {
    let out = headroom()
        .args(["generate", "--model", "kjv-demo", "--prompt", "And God said", "--max-tokens", "12", "--device", "auto", "--stats"])
        .env("HEADROOM_DISABLE_CUDA", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.trim().len() > 5, "no text: {stdout:?}");
    assert!(stderr.contains("running on CPU: HEADROOM_DISABLE_CUDA is set"), "{stderr}");
    assert!(stderr.contains("decode"), "{stderr}");
}

#[test]
fn cuda_without_a_driver_is_a_clear_error() {
    let out = headroom()
        .args(["generate", "--model", "kjv-demo", "--prompt", "x", "--device", "cuda"])
        .env("HEADROOM_DISABLE_CUDA", "1")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--device cuda") && stderr.contains("use --device cpu"), "{stderr}");
}

#[test]
fn a_missing_model_folder_names_the_problem() {
    let out = headroom()
        .args(["generate", "--model", "/nonexistent/model", "--prompt", "x", "--device", "cpu"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/nonexistent/model") && stderr.contains("does not exist") && stderr.contains("kjv-demo"), "{stderr}");
}

#[test]
fn too_long_prompt_states_the_limits() {
    let prompt = "word ".repeat(2000);
    let out = headroom()
        .args(["generate", "--model", "kjv-demo", "--prompt", &prompt, "--max-tokens", "10", "--device", "cpu"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("context is 1024 tokens"), "{stderr}");
}

#[test]
fn plan_prints_the_breakdown_and_a_decision() {
    let out = headroom()
        .args(["plan", "--model", "kjv-demo", "--prompt-tokens", "200", "--max-tokens", "300", "--vram-total-mib", "2048", "--host-bandwidth-gbs", "20", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // Demo model: 2 × 4 layers × 4 kv heads × 32 × 4 bytes = 4 KiB per token, in whole blocks of
    // 16 positions: 500 tokens take 32 blocks.
    assert_eq!(plan["footprint"]["kv_bytes"], 4096 * 512);
    assert_eq!(plan["gpu_budget"]["reserve_bytes"], 1024 * 1024 * 1024u64);
    assert_eq!(plan["admission"]["decision"], "gpu");
    // A GPU holds the matrices in 16 bits and the norms in f32.
    let bundle = headroom_model::ModelBundle::open(headroom_model::bundle::resolve_model(headroom_model::bundle::DEMO_MODEL)).unwrap();
    let (params, norms) = (bundle.config.parameter_count() as u64, bundle.config.norm_parameter_count() as u64);
    assert_eq!(plan["gpu_budget"]["weights_bytes"], (params - norms) * 2 + norms * 4, "{plan}");
    // The whole model fits: every layer and the head on the GPU.
    assert_eq!((plan["split"]["gpu_layers"].as_u64(), plan["split"]["head_on_gpu"].as_bool()), (Some(4), Some(true)), "{plan}");

    // A layer count the model does not have is a CLI error that says what fits.
    let out = headroom()
        .args(["plan", "--model", "kjv-demo", "--prompt-tokens", "200", "--max-tokens", "300", "--vram-total-mib", "2048", "--host-bandwidth-gbs", "20", "--gpu-layers", "9"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("the model has 4 layers; at most 4 fit") && stderr.contains("gpu_layers"), "{stderr}");

    // A GPU smaller than its reserve: the request goes to CPU, with the reason.
    let out = headroom()
        .args(["plan", "--model", "kjv-demo", "--prompt-tokens", "200", "--max-tokens", "300", "--vram-total-mib", "1000", "--host-bandwidth-gbs", "20", "--json"])
        .output()
        .unwrap();
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(plan["admission"]["decision"], "cpu", "{plan}");
    assert!(plan["admission"]["reason"].as_str().unwrap().contains("more than the GPU can ever hold"));
}

#[test]
fn calibrate_stores_a_measured_workspace_that_plan_then_uses() {
    // A copy of the embedded model without its calibration file.
    let dir = std::env::temp_dir().join(format!("headroom-cli-calibrate-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let source = headroom_model::bundle::resolve_model(headroom_model::bundle::DEMO_MODEL);
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(source.join(name), dir.join(name)).unwrap();
    }
    let plan = |dir: &std::path::Path| -> serde_json::Value {
        let out = headroom()
            .args(["plan", "--prompt-tokens", "64", "--max-tokens", "64", "--json", "--model"])
            .arg(dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let before = plan(&dir);
    assert_eq!(before["calibration"]["measured"], false);
    assert!(before["calibration"]["source"].as_str().unwrap().contains("headroom calibrate"));

    let out = headroom().args(["calibrate", "--model"]).arg(&dir).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(dir.join("headroom-calibration.json").exists());
    let after = plan(&dir);
    assert_eq!(after["calibration"]["measured"], true, "{after}");
    // The CPU engine's measured workspace is what the shipped calibration says it is.
    let shipped = plan(&source);
    assert_eq!(shipped["calibration"]["measured"], true, "the embedded model ships a calibration");
    let measured = after["footprint"]["workspace_bytes"].as_f64().unwrap();
    let expected = shipped["footprint"]["workspace_bytes"].as_f64().unwrap();
    assert!((measured - expected).abs() / expected < 0.05, "{measured} vs {expected}");
    std::fs::remove_dir_all(&dir).unwrap();
}
